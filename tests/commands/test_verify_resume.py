"""``functrain verify-resume``: PASS (exit 0) on a shipped config, FAIL (exit 1) with the first differing step
when the data carries unseeded randomness, one line and exit 2 for a bad config."""

import textwrap

from functrain.commands.cli import main

# A dataset whose records get noise from an unseeded generator: every process sees other data, the kind of
# bug a user's own data code can carry into a week-long run.
NOISY_DATA = textwrap.dedent('''
    import numpy as np
    from functrain.data import datasets

    def noisy_digits(data_config):
        arrays = datasets.LOADERS["digits"](data_config)
        arrays["x"] = arrays["x"] + np.random.default_rng().normal(0, 0.1, arrays["x"].shape).astype("float32")
        return arrays

    datasets.LOADERS["noisy_digits"] = noisy_digits
''')
TINY = ["train.steps_per_call=1", "eval.every_steps=0", "model.hidden=[16]"]


def test_verify_resume_passes_on_a_shipped_config(capsys):
    assert main(["verify-resume", "configs/mlp_digits.yaml", "--steps", "8", *TINY]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS") and "params sha256 equal" in out


def test_verify_resume_fails_on_unseeded_randomness_in_the_data(tmp_path, monkeypatch, capsys):
    (tmp_path / "noisy_data.py").write_text(NOISY_DATA)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}")
    status = main(["verify-resume", "configs/mlp_digits.yaml", "--steps", "8", "--import", "noisy_data",
                   "data.name=noisy_digits", *TINY])
    out = capsys.readouterr().out
    assert status == 1, out
    assert out.startswith("FAIL") and "first difference: step 1: loss" in out


def test_verify_resume_of_a_bad_config_is_one_line_exit_2(capsys):
    assert main(["verify-resume", "configs/mlp_digits.yaml", "train.max_stepz=3"]) == 2
    assert "unknown config key 'train.max_stepz'" in capsys.readouterr().err
