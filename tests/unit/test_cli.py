"""The command line: readable table, JSON that matches `estimate`, and one-line errors with exit status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.estimate import estimate
from labkit.models.gpt import GPTConfig

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_lists_terms_phases_and_peak(capsys):
    argv = ["estimate", "--model", "gpt2-tiny", "--batch", "4", "--seq", "64", "--dtype", "mixed-bf16",
            "--optimizer", "adamw"]
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == ""
    e = estimate("gpt2-tiny", 4, 64, "mixed-bf16", "adamw")
    assert "GiB = 2**30 bytes" in out
    for t in e.peak_moment.terms:  # the terms alive at the peak
        assert not t.bytes or all(w in out for w in (t.name + " " + t.formula).split())  # a cell wraps at words
    assert "all terms of the step" not in out
    code, every, _ = run(capsys, *argv, "--all-terms")  # the whole step's terms too, a flag away
    assert code == 0 and "all terms of the step (--all-terms)" in every and "is not the peak" in every
    for t in e.terms:
        assert all(w in every for w in (t.name + " " + t.formula).split())
    for phase in ("forward", "backward", "optimizer"):
        assert any(line.startswith(phase) for line in out.splitlines())
    assert f"({e.peak.total:,} bytes) in the {e.peak_phase} phase" in out


def test_json_matches_estimate(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama-tiny", "--batch", "2", "--seq", "32",
                       "--dtype", "bf16", "--optimizer", "sgd", "--json")
    assert code == 0
    d = json.loads(out)
    e = estimate("llama-tiny", 2, 32, "bf16", "sgd")
    assert d["peak"] == e.peak.total and d["peak_phase"] == e.peak_phase and d["n_params"] == e.n_params
    assert sum(d["categories"].values()) == d["peak"]
    assert (d["model"], d["global_batch"], d["seq"], d["dtype"], d["optimizer"]) == ("llama-tiny", 2, 32, "bf16",
                                                                                     "sgd")
    assert set(d["phases"]) == {"forward", "backward", "optimizer"}
    for phase, cats in d["phases"].items():
        assert all(isinstance(v, int) for v in cats.values())
        assert cats["total"] == e.phases[phase].total == sum(v for k, v in cats.items() if k != "total")


def test_gpt_spec_builds_a_gpt_config(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "gpt:n_layer=3,n_embd=64,n_head=2,block_size=128,attention=manual,dropout=0.1,bias=false",
                       "--batch", "2", "--seq", "128", "--dtype", "fp32", "--optimizer", "adam", "--json")
    assert code == 0
    cfg = GPTConfig(n_layer=3, n_embd=64, n_head=2, block_size=128, attention="manual", dropout=0.1, bias=False)
    e = estimate(cfg, 2, 128, "fp32", "adam")
    d = json.loads(out)
    assert d["n_params"] == e.n_params and d["peak"] == e.peak.total


def test_wall_command(capsys):
    code, out, _ = run(capsys, "wall", "--models", "gpt2,llama2-70b", "--budgets", "24GiB,141GiB", "--methods", "full", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [r["model"] for r in rows] == ["gpt2", "llama2-70b"]
    assert rows[0]["fits"] == {"24 GiB": True, "141 GiB": True}
    assert rows[1]["fits"] == {"24 GiB": False, "141 GiB": False}
    code, out, _ = run(capsys, "wall", "--models", "gpt2", "--budgets", "1GiB,24GiB")
    assert code == 0 and "GiB = 2**30 bytes" in " ".join(out.split()) and "24 GiB" in out


BAD = [
    (["--model", "gpt2-tiny", "--batch", "0", "--seq", "8"], "--batch must be a positive integer, got 0"),
    (["--model", "gpt2-tiny", "--batch", "1", "--seq", "-4"], "--seq must be a positive integer"),
    (["--model", "no-such-model", "--batch", "1", "--seq", "8"], "unknown model 'no-such-model'"),
    (["--model", "gpt2-tiny", "--batch", "1", "--seq", "8", "--dtype", "fp8"], "--dtype"),
    (["--model", "gpt2-tiny", "--batch", "1", "--seq", "8", "--optimizer", "adagrad"], "--optimizer"),
    (["--model", "gpt2-tiny", "--batch", "1", "--seq", "4096"], "positions"),
    (["--model", "gpt:block_size=64", "--batch", "1", "--seq", "65"], "positions"),
    (["--model", "gpt:n_layer", "--batch", "1", "--seq", "8"], "KEY=VAL"),
    (["--model", "gpt:depth=3", "--batch", "1", "--seq", "8"], "no field 'depth'"),
    (["--model", "gpt:n_layer=two", "--batch", "1", "--seq", "8"], "n_layer must be int"),
    (["--model", "gpt:n_embd=100,n_head=3", "--batch", "1", "--seq", "8"], "divisible"),
    (["--batch", "1", "--seq", "8"], "--model"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_line_and_status_2(capsys, argv, message):
    code, out, err = run(capsys, "estimate", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("labkit estimate: error: ")
    assert message in err and "Traceback" not in err


def _python_m(*argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "labkit", *argv], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def test_python_m_labkit_json():
    p = _python_m("estimate", "--model", "gpt2", "--batch", "1", "--seq", "128", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["n_params"] == 124_439_808


def test_python_m_labkit_bad_input():
    p = _python_m("estimate", "--model", "gpt2", "--batch", "1", "--seq", "128", "--dtype", "fp4")
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr and "fp4" in p.stderr


def test_recompute_and_accumulation_options(capsys):
    from labkit.cli import main
    from labkit.estimate import estimate
    from labkit.models.gpt import GPTConfig

    assert main(["estimate", "--model", "gpt:n_layer=4,n_embd=64,block_size=64", "--batch", "8", "--seq", "64",
                 "--dtype", "fp32", "--checkpoint", "full", "--segments", "2", "--accumulate", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    e = estimate(GPTConfig(n_layer=4, n_embd=64, block_size=64), 8, 64, "fp32", "adamw", checkpoint="full",
                 segments=2, micro_batch=4)
    assert out["peak"] == e.peak.total and out["options"]["accumulate"] == 2
    for argv in (["--accumulate", "3"], ["--micro-batch", "3"], ["--checkpoint", "full", "--segments", "9"],
                 ["--accumulate", "2", "--micro-batch", "4"], ["--checkpoint", "sometimes"]):
        assert main(["estimate", "--model", "gpt:n_layer=4,n_embd=64,block_size=64", "--batch", "8",
                     "--seq", "64", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_optimizer_options(capsys):
    from labkit.cli import main

    base = ["estimate", "--model", "gpt:n_layer=2,n_embd=64,block_size=64", "--batch", "2", "--seq", "64", "--json"]
    assert main(base + ["--optimizer", "galore", "--rank", "8"]) == 0
    galore = json.loads(capsys.readouterr().out)
    assert main(base + ["--optimizer", "adamw", "--optimizer-offload", "cpu"]) == 0
    offload = json.loads(capsys.readouterr().out)
    assert offload["phases"]["optimizer"]["opt"] == 0 < galore["phases"]["optimizer"]["opt"]
    assert main(base + ["--optimizer", "galore"]) == 2  # no rank
    assert "rank" in capsys.readouterr().err


def test_selective_policy_option(capsys):
    from labkit.cli import main
    from labkit.estimate import estimate
    from labkit.models.gpt import GPTConfig

    base = ["estimate", "--model", "gpt:n_layer=2,n_embd=64,block_size=64", "--batch", "2", "--seq", "64",
            "--dtype", "fp32", "--checkpoint", "selective", "--json"]
    assert main(base + ["--selective-policy", "attention-core"]) == 0
    core = json.loads(capsys.readouterr().out)
    e = estimate(GPTConfig(n_layer=2, n_embd=64, block_size=64), 2, 64, "fp32", "adamw", checkpoint="selective",
                 selective_policy="attention-core")
    assert core["peak"] == e.peak.total and core["options"]["selective_policy"] == "attention-core"
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "selective_policy" not in plain["options"] and plain["peak"] != core["peak"]
    for argv in (["--selective-policy", "attention-core", "--checkpoint", "full"], ["--selective-policy", "most"]):
        assert main(base[:-3] + argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and "selective-policy" in err


def test_wall_states_its_recipe_and_defaults_to_qlora_s(capsys):
    """QLoRA (Dettmers et al. 2023): LLaMA-65B on one 48 GB GPU with its recipe (artidoro/qlora
    scripts/finetune_guanaco_65b.sh: 4 x 4 rows, 512 tokens, r=64, NF4, gradient checkpointing). wall's defaults
    are that recipe, its header says so, and its QLoRA-65B peak is estimate's for the same options; without
    checkpointing it does not fit, and the header says the recipe is not the paper's."""
    code, out, _ = run(capsys, "wall", "--models", "llama-65b", "--methods", "qlora", "--budgets", "48GiB,48GB", "--json")
    d = json.loads(out)
    row = d["rows"][0]
    e = estimate("llama-65b", 16, 512, "bf16", "adamw", device="cuda", checkpoint="full", micro_batch=4,
                 lora_rank=64, quant="nf4")
    assert code == 0 and row["peak"] == e.peak.total and row["fits"] == {"48 GiB": True, "48 GB": True}
    assert d["budgets_bytes"] == [48 * 2**30, 48 * 10**9]
    assert (d["batch"], d["micro_batch"], d["seq"], d["lora_rank"], d["checkpoint"]) == (16, 4, 512, 64, "full")
    assert "the QLoRA paper's" in d["recipe"] and "finetune_guanaco_65b.sh" in d["recipe"]
    code, out, _ = run(capsys, "wall", "--models", "llama-65b", "--methods", "qlora", "--budgets", "48GiB",
                       "--checkpoint", "none")
    head, last = " ".join(out.split("\nmodel ")[0].split()), out.splitlines()[-1]  # the header wraps at 120
    assert code == 0 and "checkpoint none" in head and "given; the QLoRA paper's is" in head
    assert last.split()[-1] == "no"


def test_sizes_read_gb_as_decimal_and_gib_as_binary(capsys):
    code, out, _ = run(capsys, "wall", "--models", "gpt2", "--methods", "full", "--budgets", "3.3GB,3.3GiB,3GiB", "--json")
    d = json.loads(out)
    assert code == 0 and d["budgets_bytes"] == [int(3.3e9), int(3.3 * 2**30), 3 * 2**30]
    peak = d["rows"][0]["peak"]
    assert 3.3e9 < peak <= 3.3 * 2**30  # between the two readings of "3.3 G": the units decide
    assert d["rows"][0]["fits"] == {"3.3 GB": False, "3.3 GiB": True, "3 GiB": False}
    code, _, err = run(capsys, "wall", "--models", "gpt2", "--budgets", "3GiB,3.0GiB")
    assert code == 2 and "twice" in err
    code, _, err = run(capsys, "wall", "--models", "gpt2", "--budgets", "24XB")
    assert code == 2 and "--budgets" in err


def test_estimate_help_and_the_cpu_note(capsys):
    """--device defaults to cpu on every machine: --help says so and how sizes are read; a GPU-sized step on cpu
    ends with a note that gives cuda's peak and the option."""
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    out, _ = capsys.readouterr()
    flat = " ".join(out.split())
    assert "default cpu on every machine" in flat and "--device cuda" in flat and "GB = 10**9 bytes" in flat
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--batch", "1", "--seq", "128")
    gpu = estimate("gpt2", 1, 128, device="cuda").peak.total
    note = " ".join(out[out.rindex("\nnote:") + 1:].split())  # the note's lines wrap at 120 columns
    assert code == 0 and note.startswith("note: this modelled CPU kernels") and "--device cuda" in note
    assert f"{gpu / 2**30:.2f} GiB" in note or "the same peak" in note
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--batch", "1", "--seq", "128", "--device", "cuda")
    assert "note:" not in out
    flat = " ".join(out.split())  # said once: what a GPU reports of these bytes (issue 43, item 7)
    assert flat.count("what these bytes are:") == 1 and "torch.cuda.max_memory_allocated reports" in flat
    assert "max_memory_reserved adds the caching allocator's rounding" in flat and "CUDA context" in flat
    code, out, _ = run(capsys, "estimate", "--model", "gpt2-tiny", "--batch", "1", "--seq", "8")
    assert "note:" not in out  # a tiny step is not GPU-sized


# ----------------------------------------------------------------------------- one fit rule (issue 38, item 4)
def test_estimate_budget_says_fits_tight_or_does_not_fit_by_plans_rule(capsys):
    """estimate --budget uses plan's rule (labkit.memory.units.fit_verdict: above the budget does not fit,
    within --headroom of it is tight), and plan's tight flag is that same rule."""
    from labkit.memory.units import HEADROOM, fit_verdict
    from labkit.plan import plan
    from labkit.plan.search import HEADROOM as PLAN_HEADROOM

    assert PLAN_HEADROOM == HEADROOM == 0.10
    base = ["estimate", "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--json"]
    code, out, _ = run(capsys, *base)
    peak = json.loads(out)["peak"]
    for budget, want in ((2 * peak, "fits"), (int(peak / 0.95), "tight"), (int(peak * 0.9), "does not fit"),
                         (peak, "tight")):
        code, out, _ = run(capsys, *base, "--budget", f"{budget}B")
        d = json.loads(out)
        assert code == 0 and d["verdict"] == want == fit_verdict(peak, budget) and d["budget"] == budget
        code, out, _ = run(capsys, *base[:-1], "--budget", f"{budget}B")
        assert out.rstrip().splitlines()[-1].startswith(f"budget: {want}")
    code, out, _ = run(capsys, *base, "--budget", f"{int(peak / 0.95)}B", "--headroom", "1")
    assert json.loads(out)["verdict"] == "fits"  # 5 % left is more than a 1 % headroom
    plans = plan("gpt2-tiny", memory="2MiB", device_preset="cpu", batch=8, seq=128)
    for p in plans:
        assert p.tight == (fit_verdict(p.peak, p.memory, p.headroom) == "tight")


def test_wall_flags_tight_fits_as_plan_does(capsys):
    base = ["wall", "--models", "gpt2", "--methods", "full"]
    code, out, _ = run(capsys, *base, "--json", "--budgets", "1GiB")
    peak = json.loads(out)["rows"][0]["peak"]
    budgets = [2 * peak, int(peak / 0.95), int(peak * 0.9)]
    code, out, _ = run(capsys, *base, "--json", "--budgets", ",".join(f"{b}B" for b in budgets))
    row = json.loads(out)["rows"][0]
    assert list(row["verdicts"].values()) == ["fits", "tight", "does not fit"]
    assert list(row["fits"].values()) == [True, True, False]  # tight still fits
    code, out, _ = run(capsys, *base, "--budgets", ",".join(f"{b}B" for b in budgets))
    assert out.rstrip().splitlines()[-1].split()[-3:] == ["fits", "tight", "no"]
    assert "tight: fits within 10% of the budget" in out


def test_the_first_line_says_whose_kernels(capsys):
    """estimate models CPU kernels by default and wall CUDA's: each says so in its first line."""
    code, out, _ = run(capsys, "estimate", "--model", "gpt2-tiny", "--batch", "1", "--seq", "8")
    first = out.splitlines()[0]
    assert "cpu kernels (estimate's default; wall's is cuda" in first
    code, out, _ = run(capsys, "estimate", "--model", "gpt2-tiny", "--batch", "1", "--seq", "8", "--device", "cuda")
    assert out.splitlines()[0].startswith("cuda kernels: gpt2-tiny")
    code, out, _ = run(capsys, "wall", "--models", "gpt2-tiny", "--methods", "full", "--budgets", "1GiB", "--seq", "64")
    assert out.splitlines()[0].startswith("cuda kernels (wall's default; estimate's is cpu")
    code, out, _ = run(capsys, "wall", "--models", "gpt2-tiny", "--methods", "full", "--budgets", "1GiB", "--seq", "64",
                       "--device", "cpu")
    assert out.splitlines()[0].startswith("cpu kernels;")


def test_plan_export_prints_the_targets_it_refuses(capsys, tmp_path, monkeypatch):
    """A plan that steps in backward: --export says visibly that the Trainer targets do not carry it."""
    import dataclasses

    import labkit.plan as lp

    real = lp.plan

    def stepping(*a, **k):
        plans = real(*a, **k)
        r = plans[0].recipe.replace(optimizer="adafactor", rank=None, proj_dtype=None, step_in_backward=True,
                                    micro_batch=None, optimizer_offload=None, checkpoint="none", segments=None,
                                    selective_policy="matmuls")
        return [dataclasses.replace(plans[0], recipe=r)] + plans[1:]

    monkeypatch.setattr(lp, "plan", stepping)
    argv = ["plan", "--model", "gpt2-tiny", "--memory", "2MiB", "--device-preset", "cpu", "--tokens", "8*128",
            "--top", "1", "--export", str(tmp_path / "p")]
    code, out, err = run(capsys, *argv)
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 3 and all("step_in_backward" in w for w in warnings)
    assert {w.split(" target")[0].split()[-1] for w in warnings} == {"training_args", "accelerate", "deepspeed"}
    assert "the torchrun target(s) carry every memory-changing field" in out
    code, out, err = run(capsys, *argv, "--json")
    assert json.loads(out)["export_refused"]["training_args"] == ["step_in_backward"]
    assert err.count("labkit plan: warning:") == 3


def test_plan_header_says_the_memory_as_given_and_whose_speeds(capsys):
    """--memory 80GB is 74.51 GiB: the header says so, and that the speeds are the closest preset's (issue 43)."""
    code, out, _ = run(capsys, "plan", "--model", "gpt2-tiny", "--memory", "1GB", "--batch", "2", "--seq", "32",
                       "--top", "1")
    head = " ".join(out.split("ranked by fidelity")[0].split())
    assert code == 0 and "953.67 MiB each (--memory 1GB)" in head and "the preset closest to that memory" in head
