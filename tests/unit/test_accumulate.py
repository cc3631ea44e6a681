"""Gradient accumulation: the big batch's gradient from micro-batches, at a fraction of the memory."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from labkit.accumulate import Accumulation, accumulate_grads, accumulate_step, split_sizes
from labkit.memory import Ledger
from labkit.run import make_optimizer
from labkit.models.gpt import GPT, GPTConfig
from labkit.run.policies import saved_bytes

B, T = 8, 16
RTOL = 1e-5  # fp32: relative to the largest gradient entry of each tensor


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=T))


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _assert_close(ga, gb):
    for a, b in zip(ga, gb):
        assert (a - b).abs().max().item() <= RTOL * b.abs().max().item()


@pytest.mark.parametrize("micro_batch", [8, 4, 2, 1, [3, 3, 2], [5, 1, 2], [1, 7]])
@pytest.mark.parity
def test_accumulated_gradient_equals_big_batch(micro_batch):
    m, (x, y) = _gpt(), _data()
    big = m(x, y)
    big.backward()
    ref = _grads(m)
    m.zero_grad(set_to_none=True)
    loss = accumulate_grads(m, x, y, micro_batch)
    assert abs(loss.item() - big.item()) <= RTOL * abs(big.item())
    _assert_close(_grads(m), ref)


@pytest.mark.parity
def test_loss_fn_and_one_step_like_the_big_batch():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    twin = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    F.cross_entropy(net(x), y).backward()
    opt.step()
    after_big = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        for p, v in zip(net.parameters(), twin):
            p.copy_(v)
    opt.zero_grad(set_to_none=True)
    accumulate_step(net, opt, x, y, [4, 4, 2], loss_fn=F.cross_entropy)
    _assert_close([p.detach() for p in net.parameters()], after_big)
    assert all(p.grad is None for p in net.parameters())  # the step leaves no gradients behind


def test_peak_memory_falls_with_the_micro_batch():
    m, (x, y) = _gpt(), _data()
    opt = make_optimizer(m, "sgd")
    peaks, saved = {}, {}
    for mb in (8, 4, 2, 1):
        with Ledger(m, opt) as led:
            accumulate_step(m, opt, x, y, mb)
        meas = led.measurement()
        peaks[mb], saved[mb] = meas.peak.total, saved_bytes(meas)
    assert peaks[8] > peaks[4] > peaks[2] > peaks[1]
    # the saved activations scale with the rows in flight (a few row-independent bytes aside)
    for mb in (4, 2, 1):
        assert abs(saved[mb] - saved[8] * mb / 8) <= 0.02 * saved[8]


def test_no_sync_on_all_but_the_last_micro_batch():
    class FakeDDP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.unsynced = torch.nn.Linear(4, 1), 0

        def forward(self, x):
            return self.lin(x)

        @contextlib.contextmanager
        def no_sync(self):
            self.unsynced += 1
            yield

    m = FakeDDP()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    accumulate_step(m, opt, torch.randn(6, 4), torch.randn(6, 1), 2, loss_fn=F.mse_loss)
    assert m.unsynced == 2  # 3 micro-batches: the last one all-reduces


@pytest.mark.parametrize("micro_batch", [0, -2, 3, 2.0, True, [3, 3], [4, 0, 4], [], "8", None])
def test_bad_micro_batches_raise_one_line(micro_batch):
    with pytest.raises(ValueError) as e:
        split_sizes(8, micro_batch)
    assert str(e.value).startswith("micro_batch") and "\n" not in str(e.value)


@pytest.mark.parametrize("micro_batch", [0, -2, 2.0, True, [4, 0, 4], [], "8", None])
def test_accumulation_refuses_what_split_sizes_refuses_without_a_batch(micro_batch):
    with pytest.raises(ValueError, match="^micro_batch must be a positive integer or a list of them"):
        Accumulation(micro_batch)


def test_accumulation_by_rows_is_the_plain_micro_batch():
    """Accumulation(m) and m alike: the same micro-batches, the same step; a list is kept as a tuple."""
    assert Accumulation([4, 4]).micro_batch == (4, 4) and Accumulation.of(2) == Accumulation(2, "rows", -100)
    with pytest.raises(ValueError, match="^ignore_index must be an integer"):
        Accumulation(2, "tokens", ignore_index=None)
    (x, y), losses, params = _data(), [], []
    for micro in ([3, 5], Accumulation([3, 5])):
        m = _gpt()
        losses.append(accumulate_step(m, make_optimizer(m, "sgd"), x, y, micro))
        params.append([p.detach() for p in m.parameters()])
    assert torch.equal(losses[0], losses[1]) and all(torch.equal(a, b) for a, b in zip(*params))


def test_bad_arguments_to_the_step():
    m, (x, y) = _gpt(), _data()
    opt = make_optimizer(m, "sgd")
    with pytest.raises(ValueError, match="micro_batch=3 does not divide the batch of 8.*\\[3, 3, 2\\]"):
        accumulate_step(m, opt, x, y, 3)
    with pytest.raises(ValueError, match="^max_grad_norm"):
        accumulate_step(m, opt, x, y, 4, max_grad_norm=0)
