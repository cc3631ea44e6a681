"""Gradient accumulation on padded batches: only token weighting gives the full batch's gradient.

A causal-LM loss is a mean over the counted targets (those != ignore_index). When micro-batches hold
different numbers of them (padding), weighting each micro-batch's mean by its rows m_i / B gives the
tokens of a sparse micro-batch too much weight; weighting by its counted tokens n_i / N is exact
(huggingface/transformers PR #34191 fixed the same error in the Trainer in 2024).
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from labkit.accumulate import Accumulation, accumulate_grads, accumulate_step, micro_shares
from labkit.models.gpt import GPT, GPTConfig
from labkit.run import make_optimizer

B, T, V = 8, 16, 256
RTOL = 1e-5  # fp32: relative to the largest gradient entry of each tensor (a sum in another order)
IGNORE = -100


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=V))


def _padded(lengths, seed=1):
    """Rows of the given real lengths, right-padded: pad token 0, pad targets ignore_index."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (len(lengths), T), generator=g)
    y = torch.randint(0, V, (len(lengths), T), generator=g)
    for i, n in enumerate(lengths):
        x[i, n:], y[i, n:] = 0, IGNORE
    return x, y


LENGTHS = [16, 16, 3, 1, 16, 9, 2, 16]  # micro-batches of 2 rows hold 32, 4, 25 and 18 counted targets


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _worst(ga, gb):
    """Largest |a - b| over each tensor, relative to that tensor's largest |b|, over all tensors."""
    return max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(ga, gb))


def _full_batch(x, y):
    m = _gpt()
    m(x, y).backward()  # F.cross_entropy: the mean over targets != -100
    return _grads(m)


def _accumulated(x, y, micro, weight):
    m = _gpt()
    accumulate_grads(m, x, y, Accumulation(micro, weight))
    return _grads(m)


@pytest.mark.parity
@pytest.mark.parametrize("micro", [2, 1, 4, [3, 3, 2], [1, 7]])
def test_tokens_weighting_equals_the_full_batch_on_padded_rows(micro):
    x, y = _padded(LENGTHS)
    full = _full_batch(x, y)
    assert _worst(_accumulated(x, y, micro, "tokens"), full) < RTOL
    assert _worst(_accumulated(x, y, micro, "rows"), full) > 100 * RTOL  # rows weighting is wrong here


@pytest.mark.parity
def test_without_padding_rows_and_tokens_agree():
    x, y = _padded([T] * B)
    full = _full_batch(x, y)
    assert _worst(_accumulated(x, y, 2, "rows"), full) < RTOL
    assert _worst(_accumulated(x, y, 2, "tokens"), full) < RTOL
    assert micro_shares(y, [2] * 4, "tokens") == micro_shares(y, [2] * 4, "rows") == [0.25] * 4


def test_shares_count_the_targets_that_are_not_ignored():
    _, y = _padded(LENGTHS)
    assert micro_shares(y, [2, 2, 2, 2], "tokens") == [32 / 79, 4 / 79, 25 / 79, 18 / 79]
    assert micro_shares(y, [4, 4], "rows") == [0.5, 0.5]


@pytest.mark.parity
def test_a_micro_batch_with_no_counted_target_is_skipped():
    x, y = _padded([16, 5, 0, 0, 7, 16, 0, 2])  # the second micro-batch of 2 is all padding
    full = _full_batch(x, y)
    assert _worst(_accumulated(x, y, 2, "tokens"), full) < RTOL


@pytest.mark.parity
def test_accumulate_step_with_tokens_matches_one_full_batch_sgd_step():
    x, y = _padded(LENGTHS)
    ref, acc = _gpt(), _gpt()
    before = [p.detach().clone() for p in ref.parameters()]
    opt = make_optimizer(ref, "sgd", lr=0.1)
    ref(x, y).backward()
    opt.step()
    loss = accumulate_step(acc, make_optimizer(acc, "sgd", lr=0.1), x, y, Accumulation([3, 1, 4], "tokens"))
    moved = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), before))
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), acc.parameters()))
    assert diff < RTOL * moved
    assert abs(loss.item() - F.cross_entropy(_gpt()(x).view(-1, V), y.view(-1)).item()) < 1e-5


def test_bad_weight_is_refused():
    x, y = _padded(LENGTHS)
    with pytest.raises(ValueError, match="^weight must be one of rows, tokens, got 'words'"):
        Accumulation(2, weight="words")


def test_a_batch_of_padding_only_is_refused():
    x, y = _padded(LENGTHS)
    with pytest.raises(ValueError, match="every target is ignore_index"):
        accumulate_grads(_gpt(), x, torch.full_like(y, IGNORE), Accumulation(2, "tokens"))


# ---- parity with a production accumulation: accelerate, normalised by the accumulated tokens --------
@pytest.mark.parity
def test_parity_with_accelerate_token_normalised_accumulation():
    """accelerate's documented recipe for padded batches: summed loss x steps / the tokens of the whole
    accumulated batch (Accelerator.backward divides by gradient_accumulation_steps); one SGD step."""
    import accelerate  # installed with peft, a labkit dependency
    from accelerate.state import AcceleratorState, GradientState

    x, y = _padded(LENGTHS)
    micro = 2
    steps = B // micro
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)
        theirs = _gpt()
        opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
        theirs, opt = accelerator.prepare(theirs, opt)
        n_items = int((y != IGNORE).sum())  # counted over the whole accumulated batch, before it starts
        for xb, yb in zip(x.split(micro), y.split(micro)):
            with accelerator.accumulate(theirs):
                logits = theirs(xb)
                loss = F.cross_entropy(logits.view(-1, V), yb.view(-1), ignore_index=IGNORE, reduction="sum")
                accelerator.backward(loss * steps * accelerator.num_processes / n_items)
                opt.step()  # accelerate's wrapped optimizer steps only at the last micro-batch
                opt.zero_grad()
        assert accelerator.sync_gradients
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    ours = _gpt()
    accumulate_step(ours, torch.optim.SGD(ours.parameters(), lr=0.1), x, y, Accumulation(micro, "tokens"))
    start = [p.detach() for p in _gpt().parameters()]
    moved = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), start))
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    assert diff < RTOL * moved

    rows = _gpt()  # and the rows-weighted accumulation differs from it: the parity can fail
    accumulate_step(rows, torch.optim.SGD(rows.parameters(), lr=0.1), x, y, Accumulation(micro, "rows"))
    assert max((a - b).abs().max().item() for a, b in zip(rows.parameters(), theirs.parameters())) > 100 * RTOL * moved
