"""Lessons 05-06: every reference solution passes its check; blanks and plausible wrong answers fail, with a hint."""

import copy
import math

import pytest
import torch

from labkit.exercises import lesson05, lesson06
from labkit.memory import Category, Ledger
from labkit.run import train_step
from labkit.models.gpt import GPT, GPTConfig
from labkit.optim import StepInBackward

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
MAT = (4096, 11008)  # a Llama-7B MLP matrix
TALL = (1024, 256)  # m > n: the projector sits on the right


# ---- lesson 05, exercise 1: 8-bit Adam's state, a function checked on fresh sizes --------------------------------
def test_adam8bit_solution_passes_on_fresh_sizes(sol05, says):
    for seed in range(5):
        assert lesson05.check_adam8bit_state_bytes(sol05.adam8bit_state_bytes, seed=seed) is True
    assert "❌" not in says("✅", "min_8bit_size")
    assert sol05.adam8bit_state_bytes(1000 * 1000) == 2_031_256 and sol05.adam8bit_state_bytes(1000) == 8_000


def test_adam8bit_fresh_sizes_cover_both_rules_and_another_block():
    cases = lesson05._adam8bit_cases(7)
    assert any(n < floor for n, _, floor in cases) and any(n >= floor for n, _, floor in cases)
    assert any(block != 256 for _, block, _ in cases)
    assert all(n % block for n, block, floor in cases if n >= floor and floor == 4096)  # a short last block


def test_adam8bit_blank_fails(blank, says):
    assert lesson05.check_adam8bit_state_bytes(blank, seed=0) is False
    says("❌", "not answered yet")


def test_the_library_call_as_is_does_not_pass(says):
    """Issue 41 item 3: labkit.optim.adam8bit.state_bytes_for takes a shape, the exercise asks for n, blocksize and
    min_8bit_size: offered as the answer, it fails (a learner who wraps it has read the rule)."""
    from labkit.optim import adafactor, adam8bit

    assert lesson05.check_adam8bit_state_bytes(adam8bit.state_bytes_for, seed=0) is False
    assert lesson05.check_adafactor_state_bytes(adafactor.state_bytes_for, seed=0) is False


def _ceil(n, b):
    return math.ceil(n / b)


@pytest.mark.parametrize("fn, hint", [
    (lambda n, b, m: 8 * n, "fp32 Adam"),
    (lambda n, b, m: 2 * n if n >= m else 8 * n, "absmax"),
    (lambda n, b, m: 2 * n + 4 * _ceil(n, b) if n >= m else 8 * n, "own absmax"),
    (lambda n, b, m: n + 4 * _ceil(n, b) if n >= m else 8 * n, "one state"),
    (lambda n, b, m: 2 * n + 8 * _ceil(n, 2048) if n >= m else 8 * n, "2048"),
    (lambda n, b, m: 2 * n + 8 * n / b if n >= m else 8 * n, "round the number of blocks up"),
    (lambda n, b, m: 12345 if n >= m else 8 * n, "1 byte per value"),
    (lambda n, b, m: 2 * n + 8 * _ceil(n, b), "min_8bit_size"),
    (lambda n, b, m: 2 * n + 8 * _ceil(n, b) if n >= m else 4 * n, "4 + 4 bytes"),
    (lambda n, b, m: str(8 * n), "expected a number"),
    (lambda n, b, m: 1 / 0, "raised ZeroDivisionError"),
])
def test_adam8bit_wrong_answers_fail(fn, hint, says):
    assert lesson05.check_adam8bit_state_bytes(fn, seed=1) is False
    says("❌", hint)


M, K = MAT


# ---- lesson 05, exercise 2: Adafactor, a function checked on fresh shapes ---------------------------------------
def test_adafactor_solution_passes_on_fresh_shapes(sol05, says):
    for seed in range(5):
        assert lesson05.check_adafactor_state_bytes(sol05.adafactor_state_bytes, seed=seed) is True
    assert "❌" not in says("✅", "Adam would keep")
    assert sol05.adafactor_state_bytes(4096, 11008) == 60_416
    assert any(beta1 is not None for *_, beta1 in lesson05._adafactor_cases(3))


def test_adafactor_blank_fails(blank, says):
    assert lesson05.check_adafactor_state_bytes(blank, seed=0) is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("fn, hint", [
    (lambda m, n, b1: 8 * m * n, "Adam's m and v"),
    (lambda m, n, b1: 4 * m * n, "full second moment"),
    (lambda m, n, b1: 4 * (m + n) + 4 * m * n, "no first moment"),
    (lambda m, n, b1: m + n, "counts values"),
    (lambda m, n, b1: 8 * (m + n), "not twice"),
    (lambda m, n, b1: 7, "row average per row"),
    (lambda m, n, b1: 4 * (m + n), "first moment"),  # right for beta1=None, wrong when beta1 is set
])
def test_adafactor_wrong_answers_fail(fn, hint, says):
    assert lesson05.check_adafactor_state_bytes(fn, seed=2) is False
    says("❌", hint)


# ---- lesson 05, exercise 3: step-in-backward's gradient bytes ---------------------------------------------------
def test_step_in_backward_solution_passes_and_matches_the_ledger(sol05, says):
    torch.manual_seed(0)
    model = GPT(CFG)
    answer = sol05.step_in_backward_grad_bytes(model)
    assert lesson05.check_step_in_backward_grad(answer, CFG) is True
    says("✅", "largest parameter")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the check's expectation is what the ledger measures at the backward peak (within its 5 %)
        m = copy.deepcopy(model)
        opt = StepInBackward(m.parameters(), torch.optim.AdamW)
        g = torch.Generator().manual_seed(0)
        with Ledger(m, opt) as led:
            for _ in range(2):
                t = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
                train_step(m, opt, t[:, :-1], t[:, 1:])
        grad = led.measurement().phases["backward"][Category.GRAD]
    finally:
        torch.set_num_threads(n)
    assert answer <= grad <= 1.05 * answer


def test_step_in_backward_blank_fails(blank, says):
    assert lesson05.check_step_in_backward_grad(blank, CFG) is False
    says("❌", "not answered yet")


def _n_params():
    return sum(p.numel() for p in GPT(CFG).parameters())


@pytest.mark.parametrize("answer, hint", [
    (lambda: 4 * _n_params(), "every gradient at once"),
    (lambda: 0, "not zero"),
    (lambda: 64 * 256, "counts values"),
    (lambda: 4 * 30_000, "tensor is the largest"),
])
def test_step_in_backward_wrong_answers_fail(answer, hint, says):
    assert lesson05.check_step_in_backward_grad(answer(), CFG) is False
    says("❌", hint)


def test_step_in_backward_whole_block_fails(says):
    from labkit.estimate import spec_from

    spec = spec_from(CFG)
    assert lesson05.check_step_in_backward_grad(4 * spec.layer_params, CFG) is False
    says("❌", "whole block")


# ---- lesson 06, exercise 1: GaLore's state ---------------------------------------------------------------------
def test_galore_state_solutions_pass(sol06, says):
    assert lesson06.check_galore_state_bytes(sol06.GALORE_STATE, MAT, 128) is True
    assert lesson06.check_galore_state_bytes(sol06.galore_state_bytes(*TALL, 16), TALL, 16) is True
    assert "❌" not in says("✅", "the smaller side")
    assert sol06.GALORE_STATE == 13_369_344


def test_galore_state_blank_fails(blank, says):
    assert lesson06.check_galore_state_bytes(blank, MAT, 128) is False
    says("❌", "not answered yet")


R = 128


@pytest.mark.parametrize("answer, hint", [
    (8 * M * K, "AdamW's state"),
    (4 * R * (K + 2 * M), "swapped"),
    (8 * R * K, "projector"),
    (4 * R * (M + K), "two moments"),
    (R * (M + 2 * K), "counts values"),
    (1, "add the projector"),
])
def test_galore_state_wrong_answers_fail(answer, hint, says):
    assert lesson06.check_galore_state_bytes(answer, MAT, R) is False
    says("❌", hint)


# ---- lesson 06, exercise 2: the break-even rank -----------------------------------------------------------------
def test_break_even_solutions_pass(sol06, says):
    assert lesson06.check_break_even_rank(sol06.BREAK_EVEN_RANK, MAT) is True
    assert lesson06.check_break_even_rank(sol06.break_even_rank(*TALL), TALL) is True
    assert lesson06.check_break_even_rank(sol06.break_even_rank(64, 64), (64, 64)) is True  # 2n/3, rounded up
    assert "❌" not in says("✅")
    assert sol06.BREAK_EVEN_RANK == 3454 and sol06.break_even_rank(64, 64) == 43


def test_break_even_blank_fails(blank, says):
    assert lesson06.check_break_even_rank(blank, MAT) is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("shape, answer, hint", [
    (MAT, 4096, "full rank"),
    (MAT, 3453, "Round up"),
    (MAT, math.ceil(M * K / (M + 2 * K)), "not mn"),
    (TALL, math.ceil(2 * 1024 * 256 / (1024 + 2 * 256)), "swapped"),
    (MAT, 3454.5, "whole number"),
    (MAT, 10, "smallest whole r"),
])
def test_break_even_wrong_answers_fail(shape, answer, hint, says):
    assert lesson06.check_break_even_rank(answer, shape) is False
    says("❌", hint)


def test_galore_checks_refuse_a_vector():
    with pytest.raises(ValueError, match="shape"):
        lesson06.check_break_even_rank(1, (10,))


# ---- lesson 05, exercise 4: state_bytes(optimizer, shape) on fresh shapes -----------------------------------
def test_state_bytes_solution_passes_on_fresh_shapes(sol05, says):
    assert lesson05.check_state_bytes(sol05.my_state_bytes, seed=1) is True
    says("✅", "fresh shapes")
    assert lesson05.check_state_bytes(sol05.my_state_bytes, seed=2) is True
    assert lesson05._shapes(1) != lesson05._shapes(2)


def test_state_bytes_shapes_cover_both_rules():
    for seed in range(20):
        big, small, vec = lesson05._shapes(seed)
        assert math.prod(big) >= 4096 and math.prod(big) % 256 and math.prod(small) < 4096 and len(vec) == 1


def test_state_bytes_slips_fail_with_a_hint(sol05, says, blank):
    def no_min_size(optimizer, shape):  # 8-bit for every tensor
        if optimizer == "adam8bit":
            n = math.prod(shape)
            return 2 * n + 8 * math.ceil(n / 256)
        return sol05.my_state_bytes(optimizer, shape)

    assert lesson05.check_state_bytes(no_min_size, seed=1) is False
    says("❌", "'adam8bit'", "min_8bit_size")

    def floor_blocks(optimizer, shape):  # the last, shorter block forgotten
        n = math.prod(shape)
        if optimizer == "adam8bit" and n >= 4096:
            return 2 * n + 8 * (n // 256)
        return sol05.my_state_bytes(optimizer, shape)

    assert lesson05.check_state_bytes(floor_blocks, seed=1) is False
    says("❌", "block count")

    def adafactor_full_v(optimizer, shape):
        return 4 * math.prod(shape) if optimizer == "adafactor" else sol05.my_state_bytes(optimizer, shape)

    assert lesson05.check_state_bytes(adafactor_full_v, seed=1) is False
    says("❌", "'adafactor'", "row and column")

    def boom(optimizer, shape):
        raise KeyError(optimizer)

    assert lesson05.check_state_bytes(boom, seed=1) is False
    says("❌", "raised KeyError")
    assert lesson05.check_state_bytes(42, seed=1) is False
    says("❌", "expected a function")
    assert lesson05.check_state_bytes(blank) is False
    says("❌", "not answered")


def test_why_small(sol05, says, blank):
    assert lesson05.check_why_small(sol05.WHY_SMALL) is True
    says("✅", "6 bytes per value")
    assert lesson05.check_why_small("a") is False
    says("❌", "section 2.1")
    assert lesson05.check_why_small("(C)") is False
    says("❌", "padded")
    assert lesson05.check_why_small("d") is False
    says("❌", "one of")
    assert lesson05.check_why_small(blank) is False
    says("❌", "not answered")


# ---- lesson 06, exercise 3: galore_gpt_state(cfg, r) on fresh configurations ----------------------------------
def test_galore_gpt_state_solution_passes_on_fresh_configs(sol06, says):
    assert lesson06.check_galore_gpt_state(sol06.galore_gpt_state, seed=1) is True
    says("✅", "fresh GPT configurations")
    assert lesson06.check_galore_gpt_state(sol06.galore_gpt_state, seed=2) is True
    assert lesson06._configs(1) != lesson06._configs(2)
    assert {cfg.bias for seed in range(3) for cfg, _ in lesson06._configs(seed)} == {True, False}


def test_galore_gpt_state_reference_is_the_optimizers_and_the_estimators():
    """The meta-device reference equals the state a real GaLoreAdamW holds after a step, and the estimator's count."""
    import torch

    from labkit.estimate import spec_from
    from labkit.estimate.optim_terms import state_bytes
    from labkit.models.gpt import GPT, GPTConfig
    from labkit.optim import GaLoreAdamW
    from labkit.optim.galore import galore_param_groups

    cfg, r = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=12, bias=False), 3
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = GaLoreAdamW(galore_param_groups(model, rank=r), lr=1e-3)
    x = torch.randint(0, 40, (2, 8))
    model(x, x).backward()
    opt.step()
    held = sum(t.nbytes for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    assert lesson06.galore_gpt_state(cfg, r) == held == state_bytes(spec_from(cfg), 4, "galore", r)


def test_galore_gpt_state_slips_fail_with_a_hint(says, blank):
    mats = lambda d: [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]

    def rest(cfg):
        d, L = cfg.n_embd, cfg.n_layer
        lin_b = L * 9 * d if cfg.bias else 0
        return 8 * (cfg.vocab_size * d + cfg.block_size * d + lin_b + (2 * L + 1) * d * (2 if cfg.bias else 1))

    def larger_side(cfg, r):  # projector on the larger side
        return cfg.n_layer * sum(4 * r * (max(a, b) + 2 * min(a, b)) for a, b in mats(cfg.n_embd)) + rest(cfg)

    assert lesson06.check_galore_gpt_state(larger_side, seed=1) is False
    says("❌", "wrong for", "tall (out > in)")

    def matrices_only(cfg, r):
        return cfg.n_layer * sum(4 * r * (min(a, b) + 2 * max(a, b)) for a, b in mats(cfg.n_embd))

    assert lesson06.check_galore_gpt_state(matrices_only, seed=1) is False
    says("❌", "GaLore matrices only")

    def untied(cfg, r):
        return matrices_only(cfg, r) + rest(cfg) + 8 * cfg.vocab_size * cfg.n_embd

    assert lesson06.check_galore_gpt_state(untied, seed=1) is False
    says("❌", "tied")

    def boom(cfg, r):
        raise ZeroDivisionError("oops")

    assert lesson06.check_galore_gpt_state(boom, seed=1) is False
    says("❌", "raised ZeroDivisionError")
    assert lesson06.check_galore_gpt_state(lambda cfg, r: 7, seed=1) is False
    says("❌", "print(GPT(cfg))")
    assert lesson06.check_galore_gpt_state(blank) is False
    says("❌", "not answered")


def test_why_rank(sol06, says, blank):
    assert lesson06.check_why_rank(sol06.WHY_RANK) is True
    says("✅", "different subspaces")
    assert lesson06.check_why_rank("a") is False
    says("❌", "m and v")
    assert lesson06.check_why_rank("c") is False
    says("❌", "SVD")
    assert lesson06.check_why_rank("x") is False
    says("❌", "one of")
    assert lesson06.check_why_rank(blank) is False
    says("❌", "not answered")


# ---- lessons 05-06: the inputs each student draws (labkit.exercises.Inputs) -----------------------------------
def _quiet_56(check, *args, **kwargs) -> bool:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return check(*args, **kwargs)


def _two_students_56(inputs, key, solve):
    """Two students whose drawn inputs give different answers: (inputs, answer) of each."""
    seen = []
    for i in range(200):
        drawn = inputs(key, f"s{i}", quiet=True)
        answer = solve(drawn)
        for drawn2, answer2 in seen:
            if answer2 != answer:
                return (drawn2, answer2), (drawn, answer)
        seen.append((drawn, answer))
    raise AssertionError(f"every student draws the same answer for {key}")


def _sib_answer(sol05, drawn):
    from dataclasses import replace

    with torch.device("meta"):
        model = GPT(replace(CFG, vocab_size=drawn.vocab_size))
    return sol05.step_in_backward_grad_bytes(model, drawn.bytes_per_value)


def test_lesson05_06_own_inputs_are_the_lessons(monkeypatch):
    monkeypatch.delenv("LABKIT_STUDENT", raising=False)
    assert lesson05.inputs("step_in_backward_grad") == {"vocab_size": 256, "bytes_per_value": 4}
    assert CFG.vocab_size == 256  # the lesson's CONFIG (every profile): the byte tokenizer's vocabulary
    assert lesson06.inputs("galore_state_bytes") == {"shape": (4096, 11008), "rank": 128}
    assert lesson06.inputs("break_even_rank") == {"shape": (4096, 11008)}


def test_step_in_backward_every_input_passes_and_another_students_answer_fails(sol05):
    every = lesson05.inputs.every("step_in_backward_grad")
    assert len(every) <= 24
    answers = [_sib_answer(sol05, d) for d in every]
    assert len(set(answers)) == len(answers)
    for drawn, right in zip(every, answers):
        assert _quiet_56(lesson05.check_step_in_backward_grad, right, CFG, **drawn) is True, drawn
        for other in every:
            if other != drawn:  # within the check's 5 %: no two inputs' answers are that close
                assert _quiet_56(lesson05.check_step_in_backward_grad, right, CFG, **other) is False, (drawn, other)
    (_, mine), (theirs, _) = _two_students_56(lesson05.inputs, "step_in_backward_grad", lambda d: _sib_answer(sol05, d))
    assert _quiet_56(lesson05.check_step_in_backward_grad, mine, CFG, **theirs) is False


def test_step_in_backward_a_bigger_vocabulary_makes_the_embedding_the_largest(sol05, says):
    assert lesson05.check_step_in_backward_grad(2 * 8192 * CFG.n_embd, CFG, bytes_per_value=2, vocab_size=8192) is True
    says("✅", f"{8192 * CFG.n_embd:,} values x 2 B")
    assert lesson05.check_step_in_backward_grad(8192 * CFG.n_embd, CFG, bytes_per_value=2, vocab_size=8192) is False
    says("❌", "counts values", "2 bytes")
    with pytest.raises(ValueError, match="GPTConfig"):
        lesson05.check_step_in_backward_grad(1, "gpt2", vocab_size=8192)


@pytest.mark.parametrize("key, solve", [
    ("galore_state_bytes", lambda sol06, d: sol06.galore_state_bytes(*d.shape, d.rank)),
    ("break_even_rank", lambda sol06, d: sol06.break_even_rank(*d.shape)),
])
def test_galore_every_input_passes_and_another_students_answer_fails(sol06, key, solve):
    check = getattr(lesson06, f"check_{key}")
    every = lesson06.inputs.every(key)
    assert len(every) <= 24
    answers = [solve(sol06, d) for d in every]
    assert len(set(answers)) == len(answers)  # no two choices share an answer (transposed shapes would)
    for drawn, right in zip(every, answers):
        assert _quiet_56(check, right, **drawn) is True, drawn
        for other in every:
            if other != drawn:
                assert _quiet_56(check, right, **other) is False, (drawn, other)
    (_, mine), (theirs, _) = _two_students_56(lesson06.inputs, key, lambda d: solve(sol06, d))
    assert _quiet_56(check, mine, **theirs) is False
