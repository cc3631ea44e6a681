"""Chunked cross-entropy (labkit.recompute.chunked_ce): parity with F.cross_entropy, and the ledger."""

import pytest
import torch
import torch.nn.functional as F

from labkit.memory import Ledger
from labkit.models.gpt import GPT, GPTConfig
from labkit.recompute.chunked_ce import chunked_cross_entropy

R, H, V = 50, 16, 97


def _data(dtype, ignore_every=7, seed=0):
    torch.manual_seed(seed)
    h, w = torch.randn(R, H, dtype=dtype), torch.randn(V, H, dtype=dtype)
    t = torch.randint(0, V, (R,))
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t


def _grads(fn, h, w, t):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, t)
    return (loss, *torch.autograd.grad(loss, (h, w)))


def _reference(h, w, t):
    return F.cross_entropy(h @ w.t(), t)


@pytest.mark.parametrize("chunk", [16, 7, 50, 64])  # divides, does not, one chunk exactly, larger than the rows
def test_fp32_equals_cross_entropy(chunk):
    """Every logit sums H products, the logsumexp V terms, the loss and dW R terms: within (H + V + R) fp32
    ulps of the largest value, with or without chunks (the mean counts only rows whose target is not -100)."""
    h, w, t = _data(torch.float32)
    ours, ref = _grads(lambda *a: chunked_cross_entropy(*a, chunk), h, w, t), _grads(_reference, h, w, t)
    K = (H + V + R) * torch.finfo(torch.float32).eps
    for name, a, b in zip(("loss", "d hidden", "d weight"), ours, ref):
        assert a.dtype == b.dtype
        assert (a - b).abs().max().item() <= K * b.abs().max().item(), name


def test_bf16_within_one_ulp_of_exact():
    """bf16 hidden states and weight: the logits and the loss run in fp32, each result rounded once to bf16,
    and each chunk's dlogits are rounded to bf16 before their matmuls (as F.cross_entropy's bf16 path does):
    against fp64 on the same inputs, within 2 bf16 ulps of the largest entry plus (H + V + R) fp32 ulps."""
    h, w, t = _data(torch.bfloat16)
    ours = _grads(lambda *a: chunked_cross_entropy(*a, 16), h, w, t)
    exact = _grads(_reference, h.double(), w.double(), t)
    K = 2 * torch.finfo(torch.bfloat16).eps + (H + V + R) * torch.finfo(torch.float32).eps
    for name, a, b in zip(("loss", "d hidden", "d weight"), ours, exact):
        assert a.dtype == torch.bfloat16
        assert (a.double() - b).abs().max().item() <= K * b.abs().max().item(), name


def test_ignored_rows_get_no_gradient_and_all_ignored_is_nan():
    h, w, t = _data(torch.float32)
    _, dh, _ = _grads(lambda *a: chunked_cross_entropy(*a, 16), h, w, t)
    assert (dh[t == -100] == 0).all() and (dh[t != -100] != 0).any()
    t[:] = -100
    assert torch.isnan(chunked_cross_entropy(h, w, t, 16)) and torch.isnan(_reference(h, w, t))


def test_a_wrong_mean_fails():
    """The tolerance can fail: the mean over all rows (ignored ones counted) is far outside it."""
    h, w, t = _data(torch.float32)
    ref = _reference(h, w, t)
    wrong = (F.cross_entropy(h @ w.t(), t, reduction="sum") / R)
    assert (wrong - ref).abs() > 100 * (H + V + R) * torch.finfo(torch.float32).eps * ref.abs()


def test_bad_input():
    h, w, t = _data(torch.float32)
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        chunked_cross_entropy(h, w, t, 0)
    with pytest.raises(ValueError, match="hidden must be"):
        chunked_cross_entropy(h, w[:, :3], t)
    with pytest.raises(ValueError, match="targets must be int64"):
        chunked_cross_entropy(h, w, t.int())
    with pytest.raises(ValueError, match="loss_chunk must be an integer >= 0"):
        GPTConfig(loss_chunk=-1)


def _gpt_step(chunk, B=4, S=64, V=2048):
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=S, vocab_size=V, loss_chunk=chunk))
    x, y = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    with Ledger(m) as led:
        loss = m(x, y)
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, led.measurement()


def test_gpt_ledger_loses_the_log_softmax():
    """labkit GPT, B=4, S=64, V=2048, fp32, measured by the ledger: saved for backward 2,695,692 B with
    F.cross_entropy, 599,568 B with loss_chunk=64. The difference is the (B S, V) fp32 log-softmax
    (2,097,152 B), less the per-row logsumexp the chunked loss keeps (B S x 4 = 1,024) and its count of
    counted rows (int64, 8), plus nll_loss's saved total weight (fp32, 4). The step's peak falls from
    7,211,400 B to 2,002,388 B: the logits, their gradient and softmax's are (B S, V) tensors too.
    Loss and gradients equal those of the unchunked model within (h + V + B S) fp32 ulps."""
    B, S, V = 4, 64, 2048
    l0, g0, m0 = _gpt_step(0)
    l1, g1, m1 = _gpt_step(64)
    assert m0.saved - m1.saved == B * S * V * 4 - B * S * 4 - 8 + 4
    assert m1.peak.total < m0.peak.total - 2 * B * S * V * 4  # at least two fewer (B S, V) fp32 tensors
    K = (32 + V + B * S) * torch.finfo(torch.float32).eps
    assert (l0 - l1).abs() <= K * l0
    for n in g0:
        assert (g0[n] - g1[n]).abs().max() <= K * g0[n].abs().max(), n


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
@pytest.mark.parametrize("rows,h,vocab,chunk", [(40, 8, 1000, 7)])
def test_scratch_bytes_is_what_the_ledger_sees(dtype, autocast, rows, h, vocab, chunk):
    """The estimator's formula (chunked_ce.scratch_bytes) against one call under the ledger: the forward's peak
    less the saved logsumexp; the backward's less the saved logsumexp and count (int64), the loss and its
    incoming gradient (the loss's dtype)."""
    from labkit.recompute.chunked_ce import scratch_bytes

    torch.manual_seed(0)
    hid = torch.randn(rows, h, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, h, dtype=dtype, requires_grad=True)
    t = torch.randint(0, vocab, (rows,))
    with Ledger() as led:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = chunked_cross_entropy(hid, w, t, chunk)
        loss.backward()
    m = led.measurement()
    lb = loss.element_size()
    fwd, bwd = scratch_bytes(rows, h, vocab, chunk, hid.element_size(), w.element_size(), 2 if autocast else lb)
    assert m.phases["forward"].total - rows * 4 == fwd
    assert m.phases["backward"].total - rows * 4 - 8 - 2 * lb == bwd


def test_the_cli_reads_the_options():
    from labkit.cli import parse_gpt_spec

    cfg = parse_gpt_spec("gpt:attention=tiled,attn_block=32,loss_chunk=64")
    assert (cfg.attention, cfg.attn_block, cfg.loss_chunk) == ("tiled", 32, 64)
    with pytest.raises(ValueError, match="attn_block must be an integer >= 1"):
        GPTConfig(attention="tiled", attn_block=0)
