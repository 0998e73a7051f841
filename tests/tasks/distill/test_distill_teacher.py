"""Opening a distillation teacher: a functrain run directory or an HF directory, refused in one line when it holds
no checkpoint or its vocabulary is not the student's."""

import flax.linen as nn
import jax
import numpy as np
import pytest
import yaml
from flax.traverse_util import flatten_dict, unflatten_dict

from functrain.checkpoint import Checkpointer
from functrain.errors import ConfigError
from functrain.models import build_model
from functrain.models.gpt import GPTConfig
from functrain.models.gpt2 import GPT2Config
from functrain.tasks.distill.teacher import check_teacher, open_teacher

TEACHER = {"name": "gpt", "vocab_size": 32, "max_len": 16, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}


def init_params(config):
    module = build_model(config)
    variables = module.init(jax.random.PRNGKey(3), np.zeros((1, 4), np.int32))
    return jax.tree.map(np.asarray, nn.meta.unbox(variables["params"]))


@pytest.fixture
def teacher_run(tmp_path):
    """A run directory with config.yaml and two checkpoints of a 2-layer GPT (step 2's params are step 1's + 1)."""
    run = tmp_path / "teacher"
    params = init_params(GPTConfig(**TEACHER))
    checkpointer = Checkpointer(run, keep=None, async_save=False)
    for step, offset in ((1, 0.0), (2, 1.0)):
        shifted = {path: leaf + offset for path, leaf in flatten_dict(params).items()}
        checkpointer.save(step, {"params": unflatten_dict(shifted)}, {"model": TEACHER})
    checkpointer.close()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": TEACHER}))
    return run, params


def assert_same_tree(got, want):
    got, want = flatten_dict(got), flatten_dict(want)
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path]), want[path])


def test_run_directory_teacher(teacher_run):
    run, params = teacher_run
    teacher = open_teacher(str(run))
    assert teacher.config == GPTConfig(**TEACHER)
    check_teacher(teacher, vocab_size=32, positions=16)
    assert_same_tree(teacher.load_params(), jax.tree.map(lambda leaf: leaf + 1.0, params))  # the newest step
    assert_same_tree(open_teacher(str(run), step=1).load_params(), params)
    logits = teacher.module.apply({"params": teacher.load_params()}, np.zeros((2, 5), np.int32))
    assert logits.shape == (2, 5, 32)


def test_hf_directory_teacher(tmp_path):
    from torch_bridge.hf import save_pretrained
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    params = init_params(config)
    save_pretrained(params, config, tmp_path / "hf")
    teacher = open_teacher(str(tmp_path / "hf"))
    assert teacher.config.name == "gpt2" and teacher.config.n_layer == 1
    assert_same_tree(teacher.load_params(), params)
    with pytest.raises(ConfigError, match="distill.teacher_step picks a checkpoint of a run directory"):
        open_teacher(str(tmp_path / "hf"), step=0)


def test_teacher_with_another_vocabulary_or_a_shorter_context_is_refused(teacher_run):
    teacher = open_teacher(str(teacher_run[0]))
    with pytest.raises(ConfigError, match="vocabulary of 32 tokens and the student 256") as caught:
        check_teacher(teacher, vocab_size=256, positions=16)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="attends over 16 positions and the data's windows have 63"):
        check_teacher(teacher, vocab_size=32, positions=63)


def test_directory_without_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "untrained").mkdir()
    (tmp_path / "untrained" / "config.yaml").write_text(yaml.safe_dump({"model": TEACHER}))
    for name in ("empty", "untrained"):
        with pytest.raises(ConfigError, match=f"distill.teacher=.*{name} holds no checkpoint") as caught:
            open_teacher(str(tmp_path / name))
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="is not a directory"):
        open_teacher(str(tmp_path / "missing"))
