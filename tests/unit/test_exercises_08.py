"""Lesson 08: every reference solution passes its check; blanks and plausible wrong answers fail, with a hint."""

import pytest
import torch

from labkit.exercises import lesson08
from labkit.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny CPU steps run faster on one thread


@pytest.fixture(scope="module")
def minilm():
    from labkit.models.minilm import load_minilm

    return load_minilm()[0]


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=32, vocab_size=64))


# ---- exercise 1: parameters LoRA trains --------------------------------------------------------------
def test_lora_params_solution_passes(sol08, minilm, gpt, says):
    answer = sol08.lora_params(minilm, ("query", "value"), 8)
    assert answer == lesson08.lora_params(minilm, ("query", "value"), 8) == 6 * 2 * 8 * (384 + 384)
    assert lesson08.check_lora_params(answer, minilm) is True
    says("✅", "12 layers", "r x (d_in + d_out)")
    assert lesson08.check_lora_params(sol08.lora_params(gpt, ("c_fc",), 4), gpt, ("c_fc",), 4) is True


def test_lora_params_blank_fails(blank, minilm, says):
    assert lesson08.check_lora_params(blank, minilm) is False
    says("❌", "not answered yet")


def test_lora_params_wrong_answers_fail_with_a_hint(minilm, says):
    r, n = 8, 12  # 12 layers of 384 x 384
    wrong = {
        n * r * 384: "one of the two",
        n * 384 * 384: "frozen weights themselves",
        n * (384 * 384 + 384): "weights and biases",
        r * (384 + 384): "every targeted layer",
        lesson08.lora_params(minilm, lesson08.find_targets(minilm, "all-linear"), r): "all-linear",
        2 * n * r * 768: "factor of 2",
        12345: "add them up",
    }
    for answer, hint in wrong.items():
        assert lesson08.check_lora_params(answer, minilm) is False, answer
        says("❌", hint)
    assert lesson08.check_lora_params(7.5, minilm) is False
    says("❌", "whole number")


# ---- exercise 2: bytes of a frozen NF4 base -------------------------------------------------------------
def test_nf4_base_bytes_solution_passes(sol08, says):
    for shape in ((4096, 4096), (512, 1024)):
        answer = sol08.nf4_base_bytes(*shape)
        assert answer == lesson08.nf4_base_bytes(*shape)
        assert lesson08.check_nf4_base_bytes(answer, shape) is True
        says("✅", "8-bit absmax per 64")
    assert abs(8 * sol08.nf4_base_bytes() / 4096**2 - 4.127) < 1e-3  # the QLoRA paper's bits per parameter


def test_nf4_base_bytes_blank_fails(blank, says):
    assert lesson08.check_nf4_base_bytes(blank, (512, 1024)) is False
    says("❌", "not answered yet")


def test_nf4_base_bytes_wrong_answers_fail_with_a_hint(says):
    n = 512 * 1024
    blocks = n // 64
    wrong = {
        n // 2 + blocks + 4 * blocks // 256: "offset",
        n // 2 + 4 * blocks: "without double quantization",
        n // 2: "codes alone",
        2 * n: "bf16",
        8 * lesson08.nf4_base_bytes(512, 1024): "bits",
        n: "add up",
    }
    for answer, hint in wrong.items():
        assert lesson08.check_nf4_base_bytes(answer, (512, 1024)) is False, answer
        says("❌", hint)


# ---- exercise 3: the most optimizer state LISA holds ----------------------------------------------------
def test_lisa_opt_solution_passes(sol08, gpt, says):
    for gamma in (1, 2):
        answer = sol08.lisa_opt_bytes(gpt, gamma)
        assert answer == lesson08.lisa_opt_bound(gpt, gamma)
        assert lesson08.check_lisa_opt_bytes(answer, gpt, gamma) is True
        says("✅", "step counters")


def test_lisa_bound_is_what_training_holds(gpt):
    """The bound the check uses is reached and never exceeded by the real LISA (and exceeded by the naive one)."""
    from labkit.peft import lisa_memory_trace

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (2, 16), generator=g),) * 2 for _ in range(8)]
    real = lisa_memory_trace(GPT(gpt.config), batches, gamma=1, interval=2)
    naive = lisa_memory_trace(GPT(gpt.config), batches, gamma=1, interval=2, naive=True)
    bound = lesson08.lisa_opt_bound(gpt, 1)
    assert max(s["OPT"] for s in real["steps"]) == bound
    assert max(s["OPT"] for s in naive["steps"]) > bound


def test_lisa_opt_blank_fails(blank, gpt, says):
    assert lesson08.check_lisa_opt_bytes(blank, gpt) is False
    says("❌", "not answered yet")


def test_lisa_opt_wrong_answers_fail_with_a_hint(gpt, says):
    layer = gpt.blocks[0]
    lay_n, lay_t = sum(p.numel() for p in layer.parameters()), len(list(layer.parameters()))
    in_layers = {id(p) for p in gpt.blocks.parameters()}
    outside = {id(p): p for p in gpt.parameters() if id(p) not in in_layers}
    out_n, out_t = sum(p.numel() for p in outside.values()), len(outside)
    total = sum(p.numel() for p in gpt.parameters())
    wrong = {
        8 * (out_n + lay_n): "step counter",
        8 * lay_n + 4 * lay_t: "always trained",
        8 * total + 4 * len(list(gpt.parameters())): "full fine-tuning",
        4 * (out_n + lay_n) + 4 * (out_t + lay_t): "two fp32 moments",
        1000: "8 bytes per parameter",
    }
    for answer, hint in wrong.items():
        assert lesson08.check_lisa_opt_bytes(answer, gpt, 1) is False, answer
        says("❌", hint)


# ---- per-student inputs: every combination a course may draw, and a classmate's answer fails -------------------
def _two_students(key):
    """The inputs of two students whose draws for exercise `key` differ."""
    drawn = [lesson08.inputs(key, f"s{i}", quiet=True) for i in range(40)]
    return drawn[0], next(d for d in drawn if d != drawn[0])


def test_inputs_on_your_own_are_the_lessons(monkeypatch):
    monkeypatch.delenv("LABKIT_STUDENT", raising=False)
    assert lesson08.inputs("lora_params") == {"targets": ("query", "value"), "r": 8}
    assert lesson08.inputs("nf4_base_bytes") == {"shape": (4096, 4096)}
    assert lesson08.inputs("lisa_opt_bytes") == {"gamma": 1}
    assert all(len(lesson08.inputs.every(k)) <= 24 for k in lesson08.inputs.table)


def test_lora_params_every_drawn_input(sol08, minilm, says):
    answers = set()
    for drawn in lesson08.inputs.every("lora_params"):
        answer = sol08.lora_params(minilm, **drawn)
        assert answer == lesson08.lora_params(minilm, **drawn) == 6 * len(drawn.targets) * drawn.r * (384 + 384)
        assert lesson08.check_lora_params(answer, minilm, **drawn) is True, drawn
        says("✅", f"{6 * len(drawn.targets)} layers", f"r x (d_in + d_out) = {drawn.r} x")
        assert lesson08.check_lora_params(answer // 2, minilm, **drawn) is False  # one matrix of two
        says("❌", "one of the two")
        answers.add(answer)
    assert len(answers) == len(lesson08.inputs.every("lora_params"))
    mine, theirs = _two_students("lora_params")
    assert lesson08.check_lora_params(sol08.lora_params(minilm, **theirs), minilm, **mine) is False


def test_nf4_base_bytes_every_drawn_input(sol08, says):
    for drawn in lesson08.inputs.every("nf4_base_bytes"):
        rows, cols = drawn.shape
        answer = sol08.nf4_base_bytes(rows, cols)
        assert answer == lesson08.nf4_base_bytes(rows, cols)
        assert lesson08.check_nf4_base_bytes(answer, **drawn) is True, drawn
        says("✅", f"{rows * cols // 2:,} (codes")
        assert lesson08.check_nf4_base_bytes(answer - 4, **drawn) is False
        says("❌", "offset")
    mine, theirs = _two_students("nf4_base_bytes")
    assert lesson08.check_nf4_base_bytes(sol08.nf4_base_bytes(*theirs.shape), **mine) is False


def test_lisa_opt_every_drawn_input(sol08, says):
    smoke = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256))  # GPT0 in smoke mode
    for drawn in lesson08.inputs.every("lisa_opt_bytes"):
        answer = sol08.lisa_opt_bytes(smoke, **drawn)
        assert answer == lesson08.lisa_opt_bound(smoke, **drawn)
        assert lesson08.check_lisa_opt_bytes(answer, smoke, **drawn) is True, drawn
        says("✅", "step counters")
    mine, theirs = _two_students("lisa_opt_bytes")
    assert lesson08.check_lisa_opt_bytes(sol08.lisa_opt_bytes(smoke, **theirs), smoke, **mine) is False


# ---- exercise 4: gpt_lora_trainable(cfg, r, targets) on fresh configurations ---------------------------------
def test_gpt_lora_trainable_solution_passes_on_fresh_configs(sol08, says):
    assert lesson08.check_gpt_lora_trainable(sol08.gpt_lora_trainable, seed=1) is True
    says("✅", "fresh GPT configurations")
    assert lesson08.check_gpt_lora_trainable(sol08.gpt_lora_trainable, seed=2) is True
    assert lesson08._gpt_targets(1) != lesson08._gpt_targets(2)
    drawn = {n for seed in range(6) for _, _, names in lesson08._gpt_targets(seed) for n in names}
    assert drawn == set(lesson08.GPT_LINEARS), drawn


def test_gpt_lora_trainable_reference_counts_a_real_model():
    """The meta-device reference agrees with apply_lora on a real (cpu) GPT, whose adapters get gradients."""
    from labkit.models.gpt import GPT, GPTConfig
    from labkit.peft import apply_lora, count_parameters

    cfg = GPTConfig(vocab_size=30, block_size=8, n_layer=2, n_head=2, n_embd=8)
    real = apply_lora(GPT(cfg), ["c_attn", "c_proj"], r=2)
    x = torch.randint(0, 30, (2, 8))
    real(x, x).backward()
    with_grad = sum(p.numel() for p in real.parameters() if p.grad is not None)
    assert lesson08.gpt_lora_trainable(cfg, 2, ["c_attn", "c_proj"]) == count_parameters(real).trainable \
        == with_grad == 2 * 2 * ((8 + 24) + (8 + 8) + (32 + 8))


def test_gpt_lora_trainable_slips_fail_with_a_hint(says, blank):
    def square(cfg, r, targets):  # every layer taken as d x d
        d = cfg.n_embd
        per = {"c_attn": 1, "attn.c_proj": 1, "c_fc": 1, "mlp.c_proj": 1, "c_proj": 2}
        n = cfg.n_layer * sum(per.get(t, 0) for t in targets) + ("lm_head" in targets)
        return n * 2 * r * d

    assert lesson08.check_gpt_lora_trainable(square, seed=1) is False
    says("❌", "print(GPT(cfg))")

    def one_block(cfg, r, targets):  # forgets n_layer
        d, V = cfg.n_embd, cfg.vocab_size
        block = {"c_attn": 4 * d, "attn.c_proj": 2 * d, "c_fc": 5 * d, "mlp.c_proj": 5 * d}
        chosen = {n for n in block if n in targets or (n.endswith(".c_proj") and "c_proj" in targets)}
        return sum(r * block[n] for n in chosen) + (r * (d + V) if "lm_head" in targets else 0)

    assert lesson08.check_gpt_lora_trainable(one_block, seed=7) is False  # seed 7 draws a model of several blocks
    says("❌", "own copy")

    def c_proj_once(cfg, r, targets):  # "c_proj" taken as the attention projection only
        d, V = cfg.n_embd, cfg.vocab_size
        block = {"c_attn": 4 * d, "attn.c_proj": 2 * d, "c_fc": 5 * d, "mlp.c_proj": 5 * d}
        chosen = {n for n in block if n in targets or (n == "attn.c_proj" and "c_proj" in targets)}
        return cfg.n_layer * sum(r * block[n] for n in chosen) + (r * (d + V) if "lm_head" in targets else 0)

    assert lesson08.check_gpt_lora_trainable(c_proj_once, seed=1) is False
    says("❌", "ending")

    def boom(cfg, r, targets):
        raise TypeError("oops")

    assert lesson08.check_gpt_lora_trainable(boom, seed=1) is False
    says("❌", "raised TypeError")
    assert lesson08.check_gpt_lora_trainable(lambda cfg, r, t: 3, seed=1) is False
    says("❌", "frozen weights")
    assert lesson08.check_gpt_lora_trainable(blank) is False
    says("❌", "not answered")


def test_why_lisa(sol08, says, blank):
    assert lesson08.check_why_lisa(sol08.WHY_LISA) is True
    says("✅", "weight norms")
    assert lesson08.check_why_lisa("a") is False
    says("❌", "requires_grad")
    assert lesson08.check_why_lisa("b") is False
    says("❌", "largest tensors")
    assert lesson08.check_why_lisa("q") is False
    says("❌", "one of")
    assert lesson08.check_why_lisa(blank) is False
    says("❌", "not answered")
