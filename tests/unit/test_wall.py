"""The memory wall table: which presets fit which budgets, consistent with `estimate`."""

import pytest

from labkit.memory import GiB
from labkit.estimate import Recipe, estimate, fit_table
from labkit.estimate.wall import default_models
from labkit.models.hf import PRESETS


def test_gpt2_fits_24_gib_and_llama2_70b_fits_nothing():
    gpt2, llama = fit_table(["gpt2", "llama2-70b"])  # B=1 S=1024 mixed-bf16 AdamW, defaults
    assert gpt2["fits"][24] and gpt2["fits"][16]
    assert llama["fits"] == {16: False, 24: False, 80: False, 141: False}


def test_rows_agree_with_estimate():
    rows = fit_table(["gpt2-medium", "llama3.2-1b"], budgets_gib=(8, 23.5, 24),
                     recipe=Recipe(None, 2, 512, "bf16", "adam", device="cuda"))
    for row in rows:
        e = estimate(row["model"], 2, 512, "bf16", "adam", device="cuda")
        assert (row["n_params"], row["peak"], row["peak_phase"]) == (e.n_params, e.peak.total, e.peak_phase)
        assert row["fits"] == {b: e.peak.total <= b * GiB for b in (8, 23.5, 24)}


def test_default_models_are_the_non_tiny_presets():
    assert default_models() == [n for n in PRESETS if "tiny" not in n]
    assert "gpt2" in default_models() and "gpt2-tiny" not in default_models()


@pytest.mark.parametrize("kwargs, match", [
    (dict(budgets_gib=(0, 16)), "budgets"), (dict(models=[]), "at least one"),
    (dict(models=["gpt2"], recipe=Recipe(None, 1, 2048)), "gpt2: seq 2048"),
    (dict(models=["gpt2"], recipe=Recipe("gpt2", 1, 1024)), "recipe must be a Recipe with model=None"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_table(**kwargs)


def test_wall_rows_say_their_dtype_and_dtype_reaches_lora(capsys):
    """Issue 43, item 8: wall's LoRA/QLoRA rows are bf16 (the QLoRA paper's) while its full rows
    are mixed-bf16: each row says its own dtype (text and JSON), and a given --dtype reaches the
    LoRA/QLoRA rows too."""
    import json

    from labkit.cli import main

    argv = ["wall", "--models", "gpt2-tiny", "--budgets", "1GiB", "--batch", "2", "--seq", "32",
            "--lora-rank", "4"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {(r["method"], r["dtype"], r["base_dtype"]) for r in d["rows"]} == {
        ("full", "mixed-bf16", None), ("lora", "bf16", "bf16"), ("qlora", "bf16", "bf16")}
    assert main(argv + ["--methods", "lora,qlora", "--dtype", "fp32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    for r in rows:
        e = estimate("gpt2-tiny", 2, 32, "fp32", device="cuda", checkpoint="full", lora_rank=4,
                     quant="nf4" if r["method"] == "qlora" else "none")
        assert (r["dtype"], r["base_dtype"], r["peak"]) == ("fp32", "fp32", e.peak.total)
    assert main(argv + ["--methods", "lora", "--dtype", "mixed-fp16", "--adapters", "fp32"]) == 0
    out = capsys.readouterr().out
    row = out.splitlines()[-1].split()
    assert row[:3] == ["gpt2-tiny", "lora", "mixed-fp16"]
    assert "frozen base in fp16" in " ".join(out.split())
