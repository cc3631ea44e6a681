"""The planner (labkit.plan): known answers from papers, found by the search with its own estimator saying they fit;
the cost model's arithmetic; the why-lines; bad input; the command line; verify against the ledger."""

import json

import pytest

from labkit.cli import main
from labkit.estimate import estimate
from labkit.estimate.recipe import Recipe
from labkit.estimate.spec import spec_from
from labkit.memory.units import GiB, MiB
from labkit.plan import NoPlanError, get_device, plan, verify
from labkit.plan import cost
from labkit.plan.devices import PRESETS, closest
from labkit.plan.search import allowed_dtypes


# ----------------------------------------------------------------------------- known answers
def test_galore8bit_per_layer_7b_on_24gb():
    """GaLore (Zhao et al. 2024, arXiv 2403.03507): 8-bit GaLore with per-layer weight updates pre-trains LLaMA 7B on
    one 24 GB GPU (RTX 4090); the README's recipe: rank 1024, activation checkpointing, batch 16 -> 22.8 GB.
    Asked without PEFT, the planner must list an 8-bit GaLore plan with step in backward that its estimator fits."""
    plans = plan("llama2-7b", memory="24GiB", device_preset="a10", batch=16, seq=256)
    galore = [p for p in plans if p.recipe.optimizer == "galore8bit" and p.recipe.step_in_backward]
    assert galore, [p.summary() for p in plans]
    p = galore[0]
    assert p.recipe.rank == 4096 // 4  # the paper's rank for hidden 4096
    assert p.peak <= 24 * GiB and p.peak == estimate(p.recipe).peak.total
    assert all(pl.method == "full" for pl in plans)
    # nothing with AdamW in fp32 master weights fits: the why-lines say so with a peak above the budget
    assert any(w.startswith("optimizer: galore8bit") and "> 24.00 GiB" in w for w in p.why)


def test_qlora_65b_on_48gb():
    """QLoRA (Dettmers et al. 2023, arXiv 2305.14314): "finetune a 65B parameter model on a single 48GB GPU". With PEFT
    the planner's best plan for llama-65b on 48 GiB is QLoRA (nothing of higher fidelity fits), within the budget."""
    plans = plan("llama-65b", memory="48GiB", peft=True, batch=16, seq=512)
    assert plans[0].method == "qlora" and plans[0].recipe.quant == "nf4"
    assert all(p.peak <= 48 * GiB for p in plans)
    assert any(w.startswith("LoRA: does not fit") for w in plans[0].why)


def test_lora_7b_on_24gb():
    """LoRA (Hu et al. 2021, arXiv 2106.09685) freezes the base: a 7B model's bf16 weights take 12.6 GiB
    (6.74e9 x 2 B), and only the adapters get gradients and AdamW state, so a 16-bit-base LoRA fits 24 GB."""
    plans = plan("llama2-7b", memory="24GiB", peft=True, optimizers="adamw", top=None, batch=1, seq=512)
    lora = [p for p in plans if p.method == "lora"]
    assert lora and lora[0].peak <= 24 * GiB
    assert lora[0].peak == estimate(lora[0].recipe).peak.total


def test_full_finetuning_7b_on_8x80gb_with_zero3():
    """ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054): stage 3 shards parameters, gradients and optimizer state
    over the data-parallel ranks, 16 psi / N bytes of model states per rank in mixed precision, so a 7B model
    trains in full (AdamW, fp32 master weights) on 8 x 80 GB. The planner lists a dp=8 ZeRO-3 plan."""
    plans = plan("llama2-7b", devices=8, memory="80GiB", device_preset="h100", batch=8, seq=1024,
                 optimizers="adamw", min_precision="mixed-bf16", top=None)
    z3 = [p for p in plans if p.recipe.zero == 3 and p.recipe.dp == 8]
    assert z3 and z3[0].peak <= 80 * GiB and z3[0].method == "full"
    assert z3[0].fidelity == cost.Fidelity(4, 1, 1)
    assert z3[0].time.comm > 0
    # ZeRO-3 sends 3 psi (N-1)/N per rank, stages 0-2 2 psi (N-1)/N: 1.5x the communication
    z0 = [p for p in plans if p.recipe.zero in (1, 2)]
    if z0:
        assert z3[0].time.comm == pytest.approx(1.5 * z0[0].time.comm)


# ----------------------------------------------------------------------------- ranking, monotonicity, why
def test_ranking_is_fidelity_then_time():
    plans = plan("gpt2-tiny", memory="2MiB", device_preset="cpu", batch=8, seq=128, peft="allow", top=None)
    keys = [((p.fidelity.method, p.fidelity.precision, p.fidelity.optimizer), -p.seconds) for p in plans]
    assert keys == sorted(keys, key=lambda k: (k[0], k[1]), reverse=True)
    assert min(p.relative for p in plans) == 1.0


def test_more_memory_never_lowers_the_best_fidelity():
    best = []
    for mib in (0.75, 1, 1.5, 2, 4, 8, 32):
        try:
            best.append(plan("gpt2-tiny", memory=int(mib * MiB), device_preset="cpu", batch=8, seq=128,
                             peft="allow", top=1)[0].fidelity)
        except NoPlanError:
            best.append(None)
    got = [f for f in best if f is not None]
    assert got and got == sorted(got)
    assert best.index(got[0]) == best.count(None)  # once a plan exists, every larger budget has one


def test_why_lines_state_the_peak_without_each_technique():
    p = plan("gpt2-tiny", memory="4MiB", device_preset="cpu", batch=8, seq=128, min_precision="fp32",
             optimizers="adamw")[0]
    r = p.recipe
    assert r.checkpoint != "none" or r.micro < r.batch
    if r.checkpoint != "none":
        line = next(w for w in p.why if w.startswith("checkpointing:"))
        without = estimate(r.replace(checkpoint="none")).peak.total
        assert without > 4 * MiB and "needed" in line
    if r.micro < r.batch:
        line = next(w for w in p.why if w.startswith("gradient accumulation:"))
        without = estimate(r.replace(micro_batch=r.batch)).peak.total
        assert without > 4 * MiB and "needed" in line
    assert p.peak <= 4 * MiB and p.binding in {t.name for t in estimate(r).peak_moment.terms}


def test_infeasible_names_smallest_peak_and_budget():
    with pytest.raises(NoPlanError, match=r"no plan fits 100\.00 KiB per device: the smallest predicted peak found is"):
        plan("gpt2-tiny", memory="100KiB", device_preset="cpu")


@pytest.mark.parametrize("kwargs,match", [
    (dict(devices=0), "devices must be"), (dict(memory="lots"), "cannot read a memory size"),
    (dict(peft="yes"), "peft must be"), (dict(tokens="8*"), "tokens must be written B\\*S"),
    (dict(min_precision="int8"), "min_precision"), (dict(optimizers="sgd2"), "optimizers must name"),
    (dict(top=0), "top must be"), (dict(device_preset="v100"), "unknown device preset"),
    (dict(batch=4, tokens="4*64"), "not both"), (dict(seq=4096), "exceeds the model's 128 positions"),
])
def test_bad_input(kwargs, match):
    args = dict(memory="8MiB") | kwargs
    with pytest.raises(ValueError, match=match):
        plan("gpt2-tiny", **args)


# ----------------------------------------------------------------------------- cost model and devices
def test_flops_full_lora_and_recompute():
    """Full training: backward = 2 x forward (dX and dW). LoRA: the base's dX only (2 N T) plus the adapters'
    dX and dW. Full checkpointing adds one forward of the blocks (Chen et al. 2016)."""
    spec = spec_from("gpt2")
    T, S = 4 * 512, 512
    attn = 4 * spec.n_layer * S * spec.attn_width * T
    full = cost.flops(Recipe("gpt2", 4, S), spec, T)
    assert full["forward"] == 2 * spec.matmul_params * T + attn and full["backward"] == 2 * full["forward"]
    ck = cost.flops(Recipe("gpt2", 4, S, checkpoint="full"), spec, T)
    assert ck["recompute"] == 2 * spec.n_layer * spec.layer_matmul_params * T + attn
    lora = cost.flops(Recipe("gpt2", 4, S, lora_rank=8), spec, T)
    adapters = (lora["forward"] - full["forward"]) / (2 * T)
    assert adapters > 0 and lora["backward"] == 2 * spec.matmul_params * T + 2 * attn + 4 * adapters * T
    assert cost.flops(Recipe("gpt2", 4, S, checkpoint="selective"), spec, T)["recompute"] == 0


def test_fidelity_order():
    f = lambda **kw: cost.Fidelity.of(Recipe("gpt2-tiny", 1, 8, **kw))  # noqa: E731
    assert f(dtype="mixed-bf16") > f(dtype="bf16") > f(dtype="bf16", optimizer="adamw8bit")
    assert f(dtype="bf16", optimizer="lion") > f(dtype="fp32", lisa_layers=1) > f(lora_rank=4) > \
        f(lora_rank=4, quant="int8") > f(lora_rank=4, quant="nf4")
    assert f(dtype="fp32") == f(dtype="mixed-bf16")


def test_devices():
    assert PRESETS["h100"].memory == 80 * GiB and PRESETS["h200"].memory == 141 * GiB
    assert PRESETS["t4"].half == "fp16" and allowed_dtypes("bf16", PRESETS["t4"]) == ["fp16", "mixed-fp16", "fp32"]
    assert allowed_dtypes("mixed-bf16", PRESETS["a10"]) == ["mixed-bf16", "fp32"]
    for d in PRESETS.values():
        assert d.tensor_flops > d.fp32_flops > 0 and d.hbm_bw > d.link_bw > 0 and d.host_bw > 0
    assert closest(24 * GiB).name == "a10" and get_device("CPU").memory > 0
    with pytest.raises(ValueError, match="unknown device preset"):
        get_device("v100")


# ----------------------------------------------------------------------------- command line
def _run(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json(capsys):
    rc, out, err = _run(capsys, "--model", "gpt2-tiny", "--memory", "2MiB", "--device-preset", "cpu",
                        "--tokens", "8*128", "--top", "2", "--json")
    assert rc == 0 and not err
    d = json.loads(out)
    assert d["memory"] == 2 * MiB and d["batch"] == 8 and d["seq"] == 128 and 1 <= len(d["plans"]) <= 2
    p = d["plans"][0]
    assert {"recipe", "peak", "binding", "seconds", "relative", "fidelity", "why", "summary"} <= set(p)
    assert p["peak"] <= 2 * MiB and p["relative"] >= 1.0 and isinstance(p["why"], list) and p["why"]


def test_cli_text(capsys):
    rc, out, _ = _run(capsys, "--model", "gpt2-tiny", "--memory", "2MiB", "--device-preset", "cpu", "--top", "1")
    assert rc == 0 and out.startswith("gpt2-tiny: 1 device(s), 2.00 MiB each") and "binding term:" in out


@pytest.mark.parametrize("argv,match", [
    (["--memory", "2MiB", "--tokens", "8*128", "--batch", "2"], "not both"),
    (["--memory", "2XB"], "--memory"), ([], "give --memory"), (["--memory", "2MiB", "--devices", "0"], "--devices"),
    (["--memory", "2MiB", "--tokens", "8x"], "--tokens must be B\\*S"),
    (["--memory", "2MiB", "--device-preset", "v100"], "unknown preset"),
    (["--memory", "2MiB", "--optimizers", "adamw,foo"], "unknown optimizer 'foo'"),
])
def test_cli_bad_input_exits_2_with_one_line(capsys, argv, match):
    import re

    rc, out, err = _run(capsys, "--model", "gpt2-tiny", *argv)
    assert rc == 2 and not out and err.count("\n") == 1 and re.search(match, err)


def test_cli_infeasible_and_verify_refusal(capsys):
    rc, _, err = _run(capsys, "--model", "gpt2-tiny", "--memory", "100KiB", "--device-preset", "cpu")
    assert rc == 1 and "smallest predicted peak found" in err and err.count("\n") == 1
    rc, _, err = _run(capsys, "--model", "llama2-7b", "--memory", "24GiB", "--verify")
    assert rc == 2 and "6,738,415,616 parameters" in err


# ----------------------------------------------------------------------------- verify
def test_verify_tiny_plan_fits_and_matches_the_ledger():
    """A plan for gpt2-tiny under a 2 MiB budget (it needs accumulation or checkpointing to fit), run for real under
    the ledger with that budget simulated: it fits, and the prediction is within 3 % of the measured peak."""
    p = plan("gpt2-tiny", memory="2MiB", device_preset="cpu", batch=4, seq=64, min_precision="fp32",
             optimizers="adamw", top=1)[0]
    v = verify(p, device="cpu")
    assert v.fits and v.measured <= 2 * MiB
    assert abs(v.error) < 0.03, str(v)
