"""What a run must be to pipeline its layers (``mesh.pipeline``): each refusal is one line naming the key and the
fix; from the command line, exit 2 and nothing written."""

import pytest

from functrain.commands.cli import main
from functrain.config.load import load_config
from functrain.config.pipeline import pipeline_schedule
from functrain.errors import ConfigError

GPT = ["model.n_layers=4", "model.scan_layers=true"]
DEEPSEEK = "name: deepseek_v3, num_hidden_layers: 4, scan_layers: true"
MIXED_QWEN = "name: qwen2_moe, num_hidden_layers: 4, mlp_only_layers: [0], scan_layers: true"
REFUSALS = {
    "stages_do_not_divide_the_layers": ("configs/char_gpt.yaml", [*GPT, "mesh.pipeline=3"],
                                        "(3 stages) x pipeline.repeats=1 does not divide the model's 4 layers; "
                                        "make stages x repeats one of 1, 2, 4"),
    "repeats_do_not_divide_the_layers": ("configs/char_gpt.yaml", [*GPT, "mesh.pipeline=2", "pipeline.repeats=4"],
                                         "pipeline.repeats=4 does not divide the model's 4 layers"),
    "unscanned_layers": ("configs/char_gpt.yaml", ["model.n_layers=4", "mesh.pipeline=2"],
                         "splits the scanned layers; set model.scan_layers=true"),
    "across_slices_too": ("configs/char_gpt.yaml", ["model.n_layers=4", "mesh.dcn_pipeline=2"],
                          "mesh.pipeline=1 x mesh.dcn_pipeline=2 (2 stages) splits the scanned layers"),
    "model_that_cannot_scan": ("configs/mlp_digits.yaml", ["mesh.pipeline=2"],
                               "model mlp does not scan its layers; set mesh.pipeline=1"),
    "user_model": ("configs/mlp_digits.yaml", ["mesh.pipeline=2", "model={target: 'tests.fake:model'}"],
                   "model given to this run does not scan its layers"),
    # DeepSeek-V3's dense first layers run outside the pipeline: its MoE layers are what the stages split.
    "deepseek_moe_layers_do_not_divide": ("configs/moe_char.yaml", [f"model={{{DEEPSEEK}, first_k_dense_replace: 1}}",
                                                                    "mesh.pipeline=2"],
                                          "(2 stages) x pipeline.repeats=1 does not divide the model's 3 layers"),
    "deepseek_without_moe_layers": ("configs/moe_char.yaml", [f"model={{{DEEPSEEK}, first_k_dense_replace: 4}}",
                                                              "mesh.pipeline=2"],
                                    "splits the mixture-of-experts layers and model deepseek_v3 has none"),
    # A dense layer amid the sparse ones: the stack's one group of 4 layers cannot split.
    "mixed_moe_stack": ("configs/moe_char.yaml", [f"model={{{MIXED_QWEN}}}", "mesh.pipeline=2"],
                        "does not divide the model's 1 groups of 4 layers"),
    "lora": ("configs/llama3_8b_qlora.yaml", ["mesh.pipeline=2"],
             "(2 stages) splits the scanned layers and model.lora's adapters are not pipelined; set mesh.pipeline=1"),
    "torch_backend": ("configs/char_gpt_torch.yaml", ["mesh.pipeline=3"],
                      "pipelines the JAX backend's scanned layers; set backend=jax or mesh.pipeline=1"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_run_that_cannot_pipeline_is_refused_in_one_line(case):
    config, overrides, message = REFUSALS[case]
    with pytest.raises(ConfigError) as raised:
        load_config(config, overrides)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_micro_batches_must_divide_each_replicas_rows():
    config = load_config("configs/char_gpt.yaml", [*GPT, "mesh.pipeline=2", "train.pipeline_microbatches=3"])
    with pytest.raises(ConfigError, match=r"train.pipeline_microbatches=3 does not divide the 16 rows each "
                                          r"data-parallel replica computes .* one of 1, 2, 4, 8, 16$"):
        pipeline_schedule(config, batch_ways=2)  # data.global_batch_size=32 over 2 replicas
    assert pipeline_schedule(config.model_copy(update={"train": config.train.model_copy(
        update={"pipeline_microbatches": None})}), batch_ways=2).microbatches == 2  # one per stage by default


def test_from_the_command_line_exit_2_and_nothing_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "configs/char_gpt.yaml", f"run.dir={run_dir}", *GPT, "mesh.pipeline=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not divide the model's 4 layers" in err
    assert not run_dir.exists()
