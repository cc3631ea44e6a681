"""The planner (labkit.plan): known answers from papers, found by the search with its own estimator saying they fit;
the cost model's arithmetic; the why-lines; bad input; the command line; verify against the ledger."""

import json

import pytest

from labkit.cli import main
from labkit.estimate import estimate
from labkit.estimate.recipe import Recipe
from labkit.estimate.spec import spec_from
from labkit.memory.units import GiB, MiB
from labkit.plan import NoPlanError, SearchOptions, get_device, plan, verify
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
    plans = plan("llama-65b", memory="48GiB", batch=16, seq=512, options=SearchOptions(peft=True))
    assert plans[0].method == "qlora" and plans[0].recipe.quant == "nf4"
    assert all(p.peak <= 48 * GiB for p in plans)
    assert any(w.startswith("LoRA: does not fit") for w in plans[0].why)


def test_lora_7b_on_24gb():
    """LoRA (Hu et al. 2021, arXiv 2106.09685) freezes the base: a 7B model's bf16 weights take 12.6 GiB
    (6.74e9 x 2 B), and only the adapters get gradients and AdamW state, so a 16-bit-base LoRA fits 24 GB."""
    plans = plan("llama2-7b", memory="24GiB", batch=1, seq=512,
                 options=SearchOptions(peft=True, optimizers="adamw", top=None))
    lora = [p for p in plans if p.method == "lora"]
    assert lora and lora[0].peak <= 24 * GiB
    assert lora[0].peak == estimate(lora[0].recipe).peak.total


def test_full_finetuning_7b_on_8x80gb_with_zero3():
    """ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054): stage 3 shards parameters, gradients and optimizer state
    over the data-parallel ranks, 16 psi / N bytes of model states per rank in mixed precision, so a 7B model
    trains in full (AdamW, fp32 master weights) on 8 x 80 GB. The planner lists a dp=8 ZeRO-3 plan."""
    plans = plan("llama2-7b", devices=8, memory="80GiB", device_preset="h100", batch=8, seq=1024,
                 options=SearchOptions(optimizers="adamw", min_precision="mixed-bf16", top=None))
    z3 = [p for p in plans if p.recipe.zero == 3 and p.recipe.dp == 8]
    assert z3 and z3[0].peak <= 80 * GiB and z3[0].method == "full"
    assert z3[0].fidelity == cost.Fidelity(precision=1, method=4, optimizer=1)
    assert z3[0].time.comm > 0
    # ZeRO-3 sends 3 psi (N-1)/N per rank, stages 0-2 2 psi (N-1)/N: 1.5x the communication
    z0 = [p for p in plans if p.recipe.zero in (1, 2)]
    if z0:
        assert z3[0].time.comm == pytest.approx(1.5 * z0[0].time.comm)


# ----------------------------------------------------------------------------- ranking, monotonicity, why
def test_ranking_is_fidelity_then_time():
    plans = plan("gpt2-tiny", memory="2MiB", device_preset="cpu", batch=8, seq=128,
                 options=SearchOptions(peft="allow", top=None))
    keys = [((p.fidelity.precision, p.fidelity.method, p.fidelity.optimizer), -p.seconds) for p in plans]
    assert keys == sorted(keys, key=lambda k: (k[0], k[1]), reverse=True)
    assert min(p.relative for p in plans) == 1.0


def test_more_memory_never_lowers_the_best_fidelity():
    best = []
    for mib in (0.75, 1, 1.5, 2, 4, 8, 32):
        try:
            best.append(plan("gpt2-tiny", memory=int(mib * MiB), device_preset="cpu", batch=8, seq=128,
                             options=SearchOptions(peft="allow", top=1))[0].fidelity)
        except NoPlanError:
            best.append(None)
    got = [f for f in best if f is not None]
    assert got and got == sorted(got)
    assert best.index(got[0]) == best.count(None)  # once a plan exists, every larger budget has one


def test_why_lines_state_the_peak_without_each_technique():
    p = plan("gpt2-tiny", memory="4MiB", device_preset="cpu", batch=8, seq=128,
             options=SearchOptions(min_precision="fp32", optimizers="adamw"))[0]
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
    (dict(tokens="8*"), "tokens must be written B\\*S"), (dict(device_preset="v100"), "unknown device preset"),
    (dict(batch=4, tokens="4*64"), "not both"), (dict(seq=4096), "exceeds the model's 128 positions"),
    (dict(options=dict(top=2)), "options must be a SearchOptions"),
])
def test_bad_input(kwargs, match):
    args = dict(memory="8MiB") | kwargs
    with pytest.raises(ValueError, match=match):
        plan("gpt2-tiny", **args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(peft="yes"), "peft must be"), (dict(min_precision="int8"), "min_precision must be"),
    (dict(optimizers="sgd2"), "optimizers must name"), (dict(optimizers=()), "optimizers must name"),
    (dict(top=0), "top must be"), (dict(headroom=1.0), "headroom must be"),
])
def test_search_options_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SearchOptions(**kwargs)


def test_search_options_defaults_are_the_old_keywords():
    o = SearchOptions(optimizers="adamw")
    assert (o.peft, o.min_precision, o.top, o.optimizers, o.headroom) == (False, "bf16", 5, ("adamw",), 0.10)
    assert SearchOptions(optimizers=["lion", "adamw"]).optimizers == ("lion", "adamw")  # a tuple: hashable


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
    """Precision first (fp32 master weights above pure 16-bit weights), then the method, then the optimizer."""
    f = lambda **kw: cost.Fidelity.of(Recipe("gpt2-tiny", 1, 8, **kw))  # noqa: E731
    assert f(dtype="mixed-bf16") > f(dtype="bf16") > f(dtype="bf16", optimizer="adamw8bit")
    assert f(dtype="fp32", lisa_layers=1) > f(lora_rank=4) > f(lora_rank=4, quant="int8") > \
        f(lora_rank=4, quant="nf4") > f(dtype="bf16", optimizer="lion")
    assert f(dtype="mixed-bf16", lora_rank=4, quant="nf4") > f(dtype="bf16") > f(dtype="bf16", lora_rank=4)
    assert f(dtype="fp32") == f(dtype="mixed-bf16")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_lost_update_is_half_a_step_of_the_format(dtype):
    """cost.LOST_UPDATE: an update below LOST_UPDATE x |w| leaves a 16-bit weight unchanged (round to nearest), and
    one of 4x that always moves it; checked on weights across the binades."""
    import torch

    dt = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
    w = (torch.rand(4096, dtype=torch.float64) * 1.99 + 0.01) * 2.0 ** torch.randint(-12, 4, (4096,))
    w = w.to(dt)
    lost = cost.LOST_UPDATE[dtype]
    assert torch.equal((w.double() + 0.999 * lost * w.double().abs()).to(dt), w)
    assert not torch.equal((w.double() + 4 * lost * w.double().abs()).to(dt), w)
    assert lost == torch.finfo(dt).eps / 4


def _pair():
    """A synthetic pair: gpt2-tiny with room for both mixed-bf16 (fp32 master weights) and pure bf16 plans."""
    return plan("gpt2-tiny", memory="64MiB", device_preset="cpu", batch=4, seq=64,
                options=SearchOptions(peft="allow", top=None))


def test_pure_16bit_ranks_below_an_equally_fitting_plan_with_fp32_master_weights():
    plans = _pair()
    kinds = [p.fidelity.precision for p in plans]
    assert 0 in kinds and 1 in kinds and kinds == sorted(kinds, reverse=True)  # every fp32-master plan first
    for p in plans:
        says = any("no fp32 master weights" in w and "updates are lost" in w for w in p.why)
        assert says == (p.recipe.dtype in ("bf16", "fp16")), (p.summary(), p.why)
    # the same family in both precisions: the fp32-master one ranks first although slower or bigger
    full_mixed = next(i for i, p in enumerate(plans) if p.method == "full" and p.recipe.dtype == "mixed-bf16")
    full_bf16 = next(i for i, p in enumerate(plans) if p.method == "full" and p.recipe.dtype == "bf16")
    assert full_mixed < full_bf16


def test_7b_on_24gb_first_answer_keeps_fp32_master_weights():
    """The issue's case: llama2-7b on one 24 GB card with PEFT allowed. Pure bf16 full training fits, and so does
    QLoRA with fp32 adapters; the fp32-master plan ranks first, the pure-bf16 ones say what they lose."""
    plans = plan("llama2-7b", memory="24GB", batch=1, seq=512, options=SearchOptions(peft="allow", top=3))
    assert plans[0].fidelity.precision == 1 and plans[0].memory == 24 * 10**9
    assert any(p.recipe.dtype == "bf16" and p.method == "full" for p in plans)
    assert any(w.startswith("full training: fits only with lower fidelity") for w in plans[0].why)


def test_headroom_flag():
    plans = plan("gpt2-tiny", memory="2MiB", device_preset="cpu", batch=8, seq=128, options=SearchOptions(top=None))
    assert {p.headroom for p in plans} == {0.10}
    for p in plans:
        assert p.tight == (p.peak > 0.9 * p.memory)
        assert p.tight == any(w.startswith("headroom: tight") for w in p.why)
        assert p.as_dict()["tight"] == p.tight
    assert any(p.tight for p in plans)
    loose = plan("gpt2-tiny", memory="2MiB", device_preset="cpu", batch=8, seq=128,
                 options=SearchOptions(top=None, headroom=0.0))
    assert not any(p.tight for p in loose)
    with pytest.raises(ValueError, match="headroom must be"):
        plan("gpt2-tiny", memory="2MiB", device_preset="cpu", options=SearchOptions(headroom=1.0))


def test_memory_units():
    from labkit.memory.units import parse_bytes

    assert parse_bytes("24GB") == 24 * 10**9 and parse_bytes("24 GiB") == 24 * GiB and parse_bytes("24gib") == 24 * GiB
    assert parse_bytes("512MB") == 512 * 10**6 and parse_bytes("512MiB") == 512 * MiB
    assert parse_bytes("1.5G") == int(1.5 * GiB)
    p = plan("gpt2-tiny", memory="3MB", device_preset="cpu", batch=4, seq=64, options=SearchOptions(top=1))[0]
    assert p.memory == 3 * 10**6


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


def test_cli_headroom_and_the_export_command(capsys, tmp_path):
    """--headroom flags plans within that share of --memory; the text ends with the command that exports plan 1,
    and that command, run, writes plan 1's files."""
    import shlex

    args = ["--model", "gpt2-tiny", "--memory", "2MiB", "--device-preset", "cpu", "--tokens", "8*128", "--top", "2"]
    rc, out, _ = _run(capsys, *args, "--headroom", "40", "--json")
    d = json.loads(out)
    assert rc == 0 and all(p["tight"] == (p["peak"] > 0.6 * d["memory"]) and p["headroom"] == 0.4 for p in d["plans"])
    rc, out, _ = _run(capsys, *args)
    command = out.rstrip().splitlines()[-1].strip()
    assert rc == 0 and command.startswith("python -m labkit plan --model gpt2-tiny") and "--export" in command
    words = shlex.split(command)[4:]
    words[words.index("--export") + 1] = str(tmp_path / "p1")
    rc, out, _ = _run(capsys, *words)
    assert rc == 0 and (tmp_path / "p1" / "training_args.json").is_file()
    rc, _, err = _run(capsys, *args, "--headroom", "100")
    assert rc == 2 and "--headroom" in err


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
    p = plan("gpt2-tiny", memory="2MiB", device_preset="cpu", batch=4, seq=64,
             options=SearchOptions(min_precision="fp32", optimizers="adamw", top=1))[0]
    v = verify(p, device="cpu")
    assert v.fits and v.measured <= 2 * MiB
    assert abs(v.error) < 0.03, str(v)


def test_why_lines_do_not_depend_on_top():
    """Issue 43, item 8: the search stops once it has `top` plans, and a plan's "LISA: does not
    fit" line used to quote only the LISA families searched by then (gpt2 at 500 MiB: 973.87 MiB
    with top=1, 588.91 MiB with every plan). The families a why-line speaks of are searched
    first."""
    kw = dict(memory="500MiB", batch=1, seq=128)
    one = plan("gpt2", 1, **kw, options=SearchOptions(peft=True, top=1))
    every = plan("gpt2", 1, **kw, options=SearchOptions(peft=True, top=None))
    assert one[0].recipe == every[0].recipe and one[0].why == every[0].why
    assert any(line.startswith("LISA: does not fit") for line in one[0].why)


def test_adafactor_time_reads_and_writes_its_factored_state_as_stored():
    """Issue 43, item 8: plan's optimizer time charged Adafactor 2 d per element, a full state's
    read and write. labkit.optim.Adafactor stores a matrix's row and column averages (a vector's
    full second moment), measured here after one step; its traffic is that state read and
    written, the weight and gradient (3 d), the gradient read again and the fp32 update written
    and read back (d + 8 per element)."""
    import torch

    from labkit.estimate import optim_terms
    from labkit.optim import Adafactor
    from labkit.run.step import build_model

    m = build_model("gpt2-tiny")
    opt = Adafactor(m.parameters())
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    stored = sum(t.nbytes for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    spec = spec_from("gpt2-tiny")
    assert stored == optim_terms.state_bytes(spec, 4, "adafactor")
    for dtype, d in (("mixed-bf16", 4), ("bf16", 2)):
        r = Recipe("gpt2-tiny", 1, 64, dtype, "adafactor")
        nbytes, _ = cost.optimizer_bytes_and_flops(r, spec)
        n = spec.n_params
        state = optim_terms.state_bytes(spec, d, "adafactor")
        assert nbytes == n * 3 * d + 2 * state + n * (d + 8)
        assert 2 * state < n * 2 * d / 10  # factored: far below a full state's 2 d per element
