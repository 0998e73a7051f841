"""The distillation program: the student and the frozen teacher in one loss, exact over micro-batches and under
packing (a packed window is its documents run alone), the teacher never trained."""

import jax
import numpy as np
import optax

from functrain.core.fields import resolve_fields
from functrain.core.adapters import model_pieces
from functrain.core.state import TrainState
from functrain.core.step import make_train_step
from functrain.data.token_store import StoreWriter, TokenStore
from functrain.data.token_windows import TokenWindows
from functrain.models import build_model
from functrain.models.gpt import GPTConfig
from functrain.tasks.distill.config import DistillConfig
from functrain.tasks.distill.task import TEACHER, distill_program

VOCAB, SEQ_LEN = 64, 15
STUDENT = GPTConfig(vocab_size=VOCAB, max_len=16, d_model=32, n_layers=1, n_heads=2, d_ff=64)
TEACHER_MODEL = GPTConfig(vocab_size=VOCAB, max_len=16, d_model=48, n_layers=2, n_heads=4, d_ff=96)
SETTINGS = DistillConfig(teacher="unused", loss="jsd", beta=0.3, temperature=1.5, alpha=0.7)


def packed_batch(tmp_path, lengths, rows):
    """``rows`` packed windows of ``SEQ_LEN`` tokens over random documents of ``lengths``."""
    rng = np.random.default_rng(0)
    with StoreWriter(tmp_path / "store", VOCAB, {"name": "test", "xxh64": None, "eos_id": None}) as writer:
        writer.add(rng.integers(0, VOCAB, sum(lengths)), lengths)
    batch = TokenWindows(TokenStore.open(tmp_path / "store"), SEQ_LEN, packing=True).gather(np.arange(rows))
    return {**batch, "weight": np.ones(rows, np.float32)}


def program_and_state(batch):
    """The distillation program of the student on ``batch``'s fields and its state, with a random teacher
    loaded (as the start hook would) whose head is scaled up: its distributions are far from the student's."""
    inputs = batch["tokens"][:, :-1]
    student = model_pieces(build_model(STUDENT), inputs, batch)
    teacher = model_pieces(build_model(TEACHER_MODEL), inputs, batch)
    program = distill_program(student, teacher, resolve_fields(batch), SETTINGS)
    params, model_state = jax.jit(program.init)(jax.random.PRNGKey(0))
    weights = teacher.init(jax.random.PRNGKey(1))[0]
    model_state[TEACHER]["params"] = {**weights, "head": {"kernel": 100 * weights["head"]["kernel"]}}
    return program, params, model_state


def test_a_packed_window_is_its_documents_alone(tmp_path):
    lengths = [5, 7, 4]
    packed = packed_batch(tmp_path, lengths, rows=1)
    program, params, model_state = program_and_state(packed)
    starts = np.cumsum([0] + lengths[:-1])
    alone = {"tokens": np.zeros((len(lengths), SEQ_LEN + 1), np.int32), "weight": np.ones(len(lengths), np.float32),
             "mask": np.arange(SEQ_LEN)[None, :] < np.array(lengths)[:, None] - 1}
    for row, (start, length) in enumerate(zip(starts, lengths)):
        alone["tokens"][row, :length] = packed["tokens"][0, start:start + length]
    loss = jax.jit(program.loss_fn)
    packed_sum, packed_count, packed_aux, _ = loss(params, model_state, packed, jax.random.PRNGKey(2))
    alone_sum, alone_count, alone_aux, _ = loss(params, model_state, alone, jax.random.PRNGKey(2))
    assert float(packed_count) == float(alone_count) == sum(lengths) - len(lengths)
    for name in ("distill", "cross_entropy"):
        np.testing.assert_allclose(float(packed_aux[name]), float(alone_aux[name]), rtol=1e-5)
        assert float(packed_aux[name]) > 1.0
    np.testing.assert_allclose(float(packed_sum), float(alone_sum), rtol=1e-5)


def test_micro_batches_are_exact_and_the_teacher_never_trains(tmp_path):
    """One SGD step (learning rate 1: the update is the gradient) on 4 packed windows, whole or as 2 micro-batches:
    the same loss, metrics and update within 1e-6; the teacher's weights come out as they went in."""
    batch = packed_batch(tmp_path, np.random.default_rng(1).integers(1, 9, 60).tolist(), rows=4)
    program, params, model_state = program_and_state(batch)
    results = []
    for micro_batches in (1, 2):
        step = jax.jit(make_train_step(program.loss_fn, optax.sgd(1.0), micro_batches=micro_batches, stateful=True))
        state = TrainState.create(params, optax.sgd(1.0), jax.random.PRNGKey(3), model_state=model_state)
        results.append(step(state, batch))
    (whole, whole_metrics), (split, split_metrics) = results
    for name in ("loss", "distill", "cross_entropy", "accuracy", "weight", "grad_norm"):
        np.testing.assert_allclose(float(whole_metrics[name]), float(split_metrics[name]), atol=1e-6, rtol=0)
    for got, want in zip(jax.tree.leaves(split.params), jax.tree.leaves(whole.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    assert float(whole_metrics["grad_norm"]) > 1e-3
    np.testing.assert_allclose(float(whole_metrics["loss"]), SETTINGS.alpha * float(whole_metrics["distill"])
                               + (1 - SETTINGS.alpha) * float(whole_metrics["cross_entropy"]), rtol=1e-6)
    for state in (whole, split):
        for got, want in zip(jax.tree.leaves(state.model_state[TEACHER]), jax.tree.leaves(model_state[TEACHER])):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_evaluation_reports_the_students_cross_entropy(tmp_path):
    batch = packed_batch(tmp_path, [6, 9, 5], rows=1)
    program, params, model_state = program_and_state(batch)
    loss_sum, _, aux, _ = jax.jit(program.eval_loss_fn)(params, model_state, batch, jax.random.PRNGKey(0))
    assert float(loss_sum) == float(aux["cross_entropy"]) and float(aux["distill"]) > 1.0
