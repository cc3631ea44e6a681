"""LoRA over a 16-bit frozen base (Recipe.base_dtype), peft's usual setup: the base in bf16, the
adapters, their gradients and AdamW state in fp32, the step under autocast. Estimate vs ledger per
category, parity with peft, the Recipe's checks, and what the planner, wall, CLI and export make
of it."""

import contextlib
import copy
import io
import json

import pytest
import torch

from labkit.estimate import Recipe, estimate
from labkit.estimate.peft_terms import adapter_elements, peft_of
from labkit.estimate.spec import spec_from
from labkit.memory import Category
from labkit.models.gpt import GPTConfig
from estimate_checks import estimate_and_measure
from labkit.run import adapters_to, apply_peft, build_model

G = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
BF16 = dict(dtype="mixed-bf16", base_dtype="bf16")

CASES = [  # (model, B, S, options)
    (G, 4, 64, dict(lora_rank=4)),
    (G, 4, 64, dict(lora_rank=16, lora_targets="c_attn")),  # frozen projections between adapted
    ("gpt2-tiny", 4, 64, dict(lora_rank=4)),
    ("llama-tiny", 4, 64, dict(lora_rank=16)),
    ("llama-tiny", 4, 64, dict(lora_rank=8, quant="nf4")),  # QLoRA: norms, embeddings in bf16
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _id(c):
    name = c[0] if isinstance(c[0], str) else f"gpt{c[0].n_embd}"
    return name + "-" + "-".join(f"{k}={v}" for k, v in c[3].items())


def _peak(recipe: Recipe) -> int:
    return estimate(recipe).peak.total


def _cli(*words) -> str:
    from labkit.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(list(words)) == 0
    return buf.getvalue()


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_each_category_agrees_with_the_ledger(case):
    """Every category at the peak within 1 % of the measured peak (the total within 0.5 %), and the
    model states exact: bf16 frozen weights + fp32 adapters, fp32 adapter gradients and AdamW
    state."""
    model, B, S, kw = case
    r = Recipe.of(model, B, S, **BF16, **kw)
    e, m = estimate_and_measure(r, tol=0.01, total_tol=0.005)
    assert e.phases["optimizer"][Category.GRAD] == m.phases["optimizer"][Category.GRAD]
    assert e.phases["backward"][Category.OPT] == m.phases["backward"][Category.OPT]
    assert e.phases["optimizer"][Category.PARAM] == m.phases["optimizer"][Category.PARAM]


def test_the_states_follow_the_formulas_and_the_base_halves():
    """PARAM = 2 B per frozen weight + 4 B per adapter; GRAD 4 B and AdamW 8 B (+ a step) per
    adapter value, as with an fp32 base; a bf16 frozen weight needs no autocast copy."""
    spec, r = spec_from(G), 8
    peft = peft_of(spec, r)
    n = adapter_elements(peft)
    fp32 = estimate(Recipe(G, 1, 8, "mixed-bf16", lora_rank=r)).phases["optimizer"]
    half = estimate(Recipe(G, 1, 8, "mixed-bf16", lora_rank=r, base_dtype="bf16"))
    opt = half.phases["optimizer"]
    assert opt[Category.PARAM] == 2 * spec.n_params + 4 * n
    assert opt[Category.GRAD] == fp32[Category.GRAD] == 4 * n
    assert opt[Category.OPT] == fp32[Category.OPT] == 8 * n + 4 * 2 * len(peft.targets)
    terms = {t.name: t.bytes for t in half.terms}
    assert terms["frozen base weights"] == 2 * spec.n_params and terms["LoRA adapters"] == 4 * n
    assert terms["autocast 16-bit weight copies"] == 2 * n  # the adapters' casts only
    book = {t.name: t.bytes for t in half.textbook}  # the textbook layer: 2 B per frozen weight
    assert book["frozen base weights"] == 2 * spec.n_params
    assert book["autocast 16-bit weight copies"] == 2 * n
    # on a 7B model the frozen weights decide: an fp32 base holds 4 B per weight and a 2-B autocast
    # copy of each matmul weight (saved for dx), a bf16 one 2 B: 44.15 GB against 17.56 GB
    big = [_peak(Recipe("llama2-7b", 1, 512, "mixed-bf16", device="cuda", lora_rank=16,
                        base_dtype=b)) for b in (None, "bf16")]
    assert 0.35 < big[1] / big[0] < 0.45


@pytest.mark.parametrize("kw, match", [
    (dict(base_dtype="bf16"), "give lora_rank too"),
    (dict(base_dtype="bf16", lisa_layers=1), "LISA moves which layers train"),
    (dict(base_dtype="int8", lora_rank=4), "base_dtype must be None, 'fp32', 'bf16' or 'fp16'"),
    (dict(base_dtype="bf16", lora_rank=4), r"give dtype='mixed-bf16'"),  # no autocast
    (dict(base_dtype="fp16", lora_rank=4, dtype="mixed-bf16"), r"give dtype='mixed-fp16'"),
    (dict(base_dtype="fp32", lora_rank=4, dtype="bf16"), "a base wider than what trains"),
])
def test_bad_base_dtype_says_what_to_do(kw, match):
    with pytest.raises(ValueError, match=match):
        Recipe.of(G, 1, 8, **kw)


def test_base_dtype_that_changes_nothing_is_accepted():
    for dtype, base in (("fp32", "fp32"), ("mixed-bf16", "fp32"), ("bf16", "bf16")):
        r = Recipe(G, 1, 8, dtype, lora_rank=4, base_dtype=base)
        assert _peak(r) == _peak(r.replace(base_dtype=None))


def test_measure_step_builds_a_bf16_base_under_fp32_adapters():
    m = build_model(G, "mixed-bf16").to(torch.bfloat16)
    apply_peft(m, "mixed-bf16", 4)
    adapters_to(m, torch.float32)
    trained = {p.dtype for p in m.parameters() if p.requires_grad}
    frozen = {p.dtype for p in m.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.bfloat16}


@pytest.mark.parity
def test_loss_and_adapter_gradients_match_peft_over_a_bf16_base():
    """peft's LoRA as its users run it (get_peft_model over a bf16 model: adapters in fp32 by its
    autocast_adapter_dtype) against labkit's as measure_step builds it, the step under bf16
    autocast, the same adapter values: the same loss and adapter gradients within a few bf16
    roundings (they come out bit-identical on this CPU)."""
    from peft import LoraConfig, get_peft_model

    from labkit.peft import LoRALinear

    torch.manual_seed(0)
    base = build_model("llama-tiny", "mixed-bf16").eval().to(torch.bfloat16)  # no dropout
    config = LoraConfig(target_modules="all-linear", r=8, lora_alpha=8)
    ref = get_peft_model(copy.deepcopy(base), config)
    mine = copy.deepcopy(base)
    apply_peft(mine, "mixed-bf16", 8, "all-linear")
    adapters_to(mine, torch.float32)
    theirs = dict(ref.named_modules())
    pairs = [(theirs["base_model.model." + n], mod) for n, mod in mine.named_modules()
             if isinstance(mod, LoRALinear)]
    assert len(pairs) == 7 * base.config.num_hidden_layers  # q k v o gate up down
    torch.manual_seed(2)
    with torch.no_grad():
        for p, q in pairs:
            assert q.scaling == p.scaling["default"] == 1.0  # alpha 8 / r 8 in both
            assert p.lora_A["default"].weight.dtype == torch.float32  # peft's adapters: fp32
            assert p.base_layer.weight.dtype == torch.bfloat16
            p.lora_B["default"].weight.normal_(std=0.02)
            q.lora_A.copy_(p.lora_A["default"].weight)
            q.lora_B.copy_(p.lora_B["default"].weight)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, base.config.vocab_size, (2, 32), generator=g)
    losses = []
    for model in (ref, mine):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    eps = torch.finfo(torch.bfloat16).eps  # 2**-7: one bf16 rounding is at most eps / 2 relative
    a, b = losses
    assert a.dtype == b.dtype == torch.float32 and abs(a - b) <= 4 * eps * abs(a), (a, b)
    for p, q in pairs:
        for ref_w, w in ((p.lora_A["default"].weight, q.lora_A),
                         (p.lora_B["default"].weight, q.lora_B)):
            assert w.grad.dtype == torch.float32
            scale = ref_w.grad.abs().max()
            assert (ref_w.grad - w.grad).abs().max() <= 4 * eps * scale, (p, scale)


def test_planner_considers_the_bf16_base_and_its_weights_bound():
    """LoRA under autocast in the planner: the frozen base in bf16, so the weights-alone bound is
    2 B per weight (lesson 13 once said an fp32 base's 25.10 GiB while pure-bf16 LoRA fitted)."""
    from labkit.estimate.spec import shapes_only
    from labkit.plan import SearchOptions, plan
    from labkit.plan.search import weights_lower_bound

    with shapes_only():
        spec = spec_from("llama2-7b")
    lora = Recipe("llama2-7b", 1, 512, "mixed-bf16", device="cuda", lora_rank=16,
                  base_dtype="bf16")
    assert weights_lower_bound(lora, spec) == 2 * spec.n_params
    assert weights_lower_bound(lora.replace(base_dtype=None), spec) == 4 * spec.n_params
    plans = plan("llama2-7b", memory="24GiB", batch=1, seq=512,
                 options=SearchOptions(peft="allow", top=None))
    best, why = plans[0].recipe, plans[0].why
    assert best.lora_rank and best.quant == "none"
    assert best.base_dtype == "bf16" and best.dtype == "mixed-bf16"
    assert "over a bf16 base" in plans[0].summary()
    assert not any("LoRA: does not fit" in w for w in why)
    # fidelity counts the trained weights: fp32 adapters keep fp32 master weights, no warning
    assert plans[0].fidelity.precision == 1
    assert not any(w.startswith("precision: pure") for w in why)
    assert any("frozen base in bf16" in w for w in why)
    assert plans[0].as_dict()["recipe"]["base_dtype"] == "bf16"
    # pure-bf16 adapters do lose small updates: that plan still says so, of the adapters
    pure = next(p for p in plans if p.recipe.lora_rank and p.recipe.dtype == "bf16")
    assert pure.fidelity.precision == 0
    assert any("no fp32 master weights for the trained adapters" in w for w in pure.why)


def test_plan_without_peft_says_what_it_left_out():
    from labkit.plan import SearchOptions, plan

    full = plan("llama2-7b", memory="24GiB", batch=1, seq=512, options=SearchOptions(top=2))
    note = "LoRA, QLoRA and LISA were not considered"
    assert any(note in w and "--peft" in w for w in full[0].why)
    assert not any(note in w for p in full[1:] for w in p.why)  # said once, under plan 1
    both = plan("llama2-7b", memory="24GiB", batch=1, seq=512,
                options=SearchOptions(peft="allow", top=1))
    assert not any(note in w for w in both[0].why)


def test_wall_and_cli_use_the_bf16_base():
    from labkit.estimate import fit_table

    # the wall's rows: adapters in the base's bf16 by default (the QLoRA paper's scripts cast
    # them), or fp32 over the bf16 base as peft keeps them
    paper, fp32 = (fit_table(["llama2-7b"], [24], methods=("lora",), adapters=a)[0]["peak"]
                   for a in ("base", "fp32"))
    ours = [_peak(Recipe("llama2-7b", 1, 1024, d, device="cuda", lora_rank=16, base_dtype=b))
            for d, b in (("bf16", None), ("mixed-bf16", "bf16"))]
    assert [paper, fp32] == ours and fp32 > paper
    with pytest.raises(ValueError, match="adapters must be 'base' or 'fp32'"):
        fit_table(["llama2-7b"], [24], methods=("lora",), adapters="fp16")
    wall = ["wall", "--models", "llama2-7b", "--methods", "lora", "--adapters"]
    words = lambda text: " ".join(text.split())  # noqa: E731 (the header wraps within 120 columns)
    assert "bf16 adapters, as the QLoRA paper's scripts" in words(_cli(*wall, "base"))
    assert "under fp32 adapters and autocast, as peft runs it" in words(_cli(*wall, "fp32"))
    out = json.loads(_cli("estimate", "--model", "llama-tiny", "--batch", "1", "--seq", "16",
                          "--dtype", "mixed-bf16", "--lora-rank", "4", "--base-dtype", "bf16",
                          "--json"))
    r = Recipe("llama-tiny", 1, 16, "mixed-bf16", lora_rank=4, base_dtype="bf16")
    assert out["options"]["base_dtype"] == "bf16" and out["peak"] == _peak(r)


def test_export_loads_the_base_in_its_dtype(tmp_path):
    """plan 1 for llama2-7b on 24 GiB is LoRA over a bf16 base: training_args.json must load the
    model in bf16 (peft keeps its adapters in fp32), or the exported run would hold an fp32 base."""
    from labkit.plan.export import export_plan

    def read(recipe, where):
        return json.loads(export_plan(recipe, tmp_path / where, 1)["training_args"].read_text())

    r = Recipe("gpt2-tiny", 2, 32, "mixed-bf16", lora_rank=8, base_dtype="bf16")
    doc = read(r, "a")
    assert doc["model"]["dtype"] == "bfloat16" and doc["bf16"] is True
    assert read(r.replace(base_dtype=None), "b")["model"]["dtype"] == "float32"
