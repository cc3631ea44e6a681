"""The command line's --from (a training config), --waterfall and compare."""

import json

import pytest

from labkit.cli import main
from labkit.estimate import estimate
from labkit.plan.configs import example_configs, read_config

LORA_3B = str(example_configs()["torchtune_llama3_2_3B_lora.yaml"])


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _small_config(tmp_path):
    """A torchtune-schema config on a model this machine reads in a second (a 2-block Llama 3.2 1B)."""
    path = tmp_path / "small.yaml"
    path.write_text("model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n  lora_attn_modules: "
                    "['q_proj', 'v_proj']\n  lora_rank: 8\ntokenizer:\n  max_seq_len: 128\nbatch_size: 2\n"
                    "gradient_accumulation_steps: 2\noptimizer:\n  _component_: torch.optim.AdamW\n"
                    "dtype: bf16\ndevice: cpu\nenable_activation_checkpointing: True\nseed: 0\n")
    return path


def test_estimate_from_a_config_prints_what_it_read_and_the_peak(capsys, tmp_path):
    path = _small_config(tmp_path)
    code, out, err = run(capsys, "estimate", "--from", str(path), "--budget", "24GiB")
    r = read_config(path).recipe
    e = estimate(r)
    assert code == 0 and err == ""
    assert out.startswith(f"read {path} (torchtune recipe config)") and "ignored (no memory effect): `seed`" in out
    assert f"({e.peak.total:,} bytes)" in out and "budget: fits" in out
    code, out, _ = run(capsys, "estimate", "--from", str(path), "--json")
    doc = json.loads(out)
    assert doc["peak"] == e.peak.total and doc["recipe"]["lora_rank"] == 8 and doc["ignored"] == {"seed": "randomness"}


def test_from_refuses_knobs_that_would_change_the_config(capsys, tmp_path):
    code, _, err = run(capsys, "estimate", "--from", str(_small_config(tmp_path)), "--checkpoint", "sqrt",
                       "--lora-rank", "4")
    assert code == 2 and "--checkpoint, --lora-rank would change it" in err


@pytest.mark.parametrize("argv, words", [
    (("estimate",), "give --model NAME, or --from PATH"),
    (("estimate", "--from", "/nonexistent/config.yaml"), "cannot read the config"),
    (("estimate", "--model", "gpt2-tiny", "--plot", "x.png"), "give --waterfall too"),
    (("estimate", "--model", "gpt2-tiny", "--verify"), "give --waterfall too"),
    (("plan", "--memory", "24GiB"), "give --model NAME, or --from PATH"),
])
def test_bad_input_is_one_line(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 2 and words in err and out == ""


def test_a_config_of_an_unknown_kind_is_refused_with_the_reason(capsys, tmp_path):
    (tmp_path / "x.yaml").write_text("foo: 1\n")
    code, _, err = run(capsys, "estimate", "--from", str(tmp_path / "x.yaml"))
    assert code == 2 and "unknown format" in err and "axolotl" in err


def test_waterfall_prints_plots_and_verifies(capsys, tmp_path):
    png = tmp_path / "w.png"
    code, out, err = run(capsys, "estimate", "--model", "gpt2-tiny", "--batch", "4", "--seq", "32",
                         "--dtype", "mixed-bf16", "--checkpoint", "full", "--waterfall", "--plot", str(png),
                         "--verify")
    assert code == 0 and err == ""
    assert "depend on the order" in out and "(measured " in out and png.read_bytes().startswith(b"\x89PNG")
    code, out, _ = run(capsys, "estimate", "--model", "gpt2-tiny", "--batch", "4", "--seq", "32",
                       "--dtype", "fp32", "--checkpoint", "full", "--waterfall", "--json")
    doc = json.loads(out)
    assert [s["knob"] for s in doc["steps"]] == [None, "checkpoint"] and "checkpoint" in doc["alone"]


def test_verify_refuses_a_model_too_big_to_run(capsys):
    code, _, err = run(capsys, "estimate", "--from", LORA_3B, "--waterfall", "--verify")
    assert code == 2 and "--verify" in err and "parameters" in err


def test_plan_and_wall_from_a_config(capsys, tmp_path):
    path = _small_config(tmp_path)
    code, out, err = run(capsys, "wall", "--from", str(path), "--budgets", "24GiB", "--methods", "lora")
    assert code == 0 and "llama3.2-1b" in out and "batch 4 = 2 micro-batches of 2" in out


def test_compare_prints_each_calculator(capsys):
    code, out, err = run(capsys, "compare", "--model", "gpt2-tiny", "--batch", "2", "--seq", "32")
    assert code == 0 and err == ""
    for tool in ("accelerate estimate-memory", "ZeRO Figure 1", "estimate_zero2", "labkit"):
        assert tool in out
    assert max(len(line) for line in out.splitlines()[1:]) <= 100
    code, out, _ = run(capsys, "compare", "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--json")
    assert json.loads(out)["exact"] == estimate("gpt2-tiny", 2, 32, "mixed-bf16").peak.total
