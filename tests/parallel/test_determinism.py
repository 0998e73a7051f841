"""train.deterministic: a GPU step compiled with XLA's deterministic ops, XLA's attention instead of cuDNN's."""

import jax
import jax.numpy as jnp
import pytest

from functrain.errors import ConfigError
from functrain.parallel.determinism import GPU_DETERMINISTIC_OPTIONS, attention_choice, step_compiler_options
from functrain.tasks.sampling import DECODER_OPTIONS


def test_a_deterministic_gpu_step_adds_the_options_to_the_tasks_and_other_platforms_keep_theirs():
    task = {"xla_cpu_experimental_ynn_fusion_type": "dot"}
    assert step_compiler_options("gpu", True, task) == {**task, **GPU_DETERMINISTIC_OPTIONS}
    assert step_compiler_options("gpu", True, None) == GPU_DETERMINISTIC_OPTIONS
    assert step_compiler_options("gpu", False, task) == task
    assert step_compiler_options("cpu", True, task) == task
    assert step_compiler_options("tpu", True, None) is None


def test_xla_accepts_the_option_names():
    # A jax whose XLA renamed the option would refuse every GPU run's compile: caught here, on any machine.
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(compiler_options=GPU_DETERMINISTIC_OPTIONS)
    assert compiled(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]


def test_a_deterministic_gpu_run_attends_with_xla_and_refuses_cudnn_in_one_line():
    assert attention_choice("auto", "gpu", True) == "xla"
    assert attention_choice("xla", "gpu", True) == "xla"
    assert attention_choice("auto", "gpu", False) == "auto"
    assert attention_choice("cudnn", "gpu", False) == "cudnn"
    assert attention_choice("auto", "tpu", True) == "auto"  # splash on a TPU: its programs are deterministic
    with pytest.raises(ConfigError, match=r"train.deterministic=false or model.attention=auto") as caught:
        attention_choice("cudnn", "gpu", True)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("platform, deterministic, expected", [
    ("gpu", True, GPU_DETERMINISTIC_OPTIONS), ("gpu", False, None), ("cpu", True, DECODER_OPTIONS)])
def test_the_sampler_compiles_as_the_step_does(platform, deterministic, expected):
    # A resumed GRPO run recompiles its sampler: on a GPU its draws are the uninterrupted run's only with the same
    # deterministic kernels as the step's.
    from types import SimpleNamespace

    from functrain.config.load import load_config
    from functrain.parallel.target import compiling_for
    from functrain.tasks.sampling import Sampler
    model = load_config(None, [], base={"model": {"name": "gpt", "vocab_size": 256, "max_len": 8, "d_model": 8,
                                                  "n_layers": 1, "n_heads": 2, "d_ff": 16},
                                         "data": {"seq_len": 8}}).model
    with compiling_for([SimpleNamespace(platform=platform, device_kind=platform)]):
        sampler = Sampler(model, None, "float32", max_new_tokens=2, temperature=1.0, deterministic=deterministic)
    assert sampler.compiler_options == expected
    assert sampler.attention == ("xla" if platform == "gpu" and deterministic else "auto")
