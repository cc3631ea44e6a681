"""Tiled attention with an online softmax (labkit.recompute.tiled_attention): parity with SDPA, and the ledger."""

import pytest
import torch
import torch.nn.functional as F

from labkit.memory import Ledger
from labkit.models.gpt import GPT, GPTConfig, CausalSelfAttention
from labkit.recompute.tiled_attention import tiled_attention

EPS32 = torch.finfo(torch.float32).eps


def _run(fn, q, k, v, g):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), g))


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# S divisible by the block, not divisible, a single partial tile, tiles smaller than the head
@pytest.mark.parametrize("S,block", [(70, 16), (33, 64), (45, 7)])
def test_fp32_equals_sdpa(S, block):
    """Each output and gradient entry sums at most S products of fp32 numbers (plus the same count of
    rescalings): both ways round at most ~S times, so they agree within 2 S ulps of the largest entry."""
    torch.manual_seed(S)
    q, k, v = (torch.randn(2, 3, S, 8) for _ in range(3))
    g = torch.randn(2, 3, S, 8)
    ours, ref = _run(lambda *a: tiled_attention(*a, block=block), q, k, v, g), _run(_sdpa, q, k, v, g)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        tol = 2 * S * EPS32 * b.abs().max().item()
        assert (a - b).abs().max().item() <= tol, (name, (a - b).abs().max().item(), tol)


@pytest.mark.parametrize("S,block", [(64, 16), (45, 7)])
def test_bf16_within_one_ulp_of_exact(S, block):
    """bf16 q, k, v: tiles run in fp32 and the results are rounded once to bf16, and the backward reads the
    bf16-rounded output and output gradient: against fp64 attention on the same inputs, one bf16 ulp of the
    largest entry plus S fp32 ulps. (SDPA's own bf16 kernel rounds its probabilities to bf16 and is further.)"""
    torch.manual_seed(S)
    q, k, v = (torch.randn(2, 3, S, 8, dtype=torch.bfloat16) for _ in range(3))
    g = torch.randn(2, 3, S, 8, dtype=torch.bfloat16)
    ours = _run(lambda *a: tiled_attention(*a, block=block), q, k, v, g)
    exact = _run(_sdpa, q.double(), k.double(), v.double(), g.double())
    bf = torch.finfo(torch.bfloat16).eps
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, exact):
        assert a.dtype == torch.bfloat16
        tol = (bf + S * EPS32) * b.abs().max().item()
        assert (a.double() - b).abs().max().item() <= tol, (name, (a.double() - b).abs().max().item(), tol)


def test_a_wrong_mask_fails():
    """The tolerance can fail: attention that sees the future is far outside it."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v)
    assert (tiled_attention(q, k, v, 16) - full).abs().max() > 100 * 2 * 40 * EPS32 * full.abs().max()


def test_bad_input():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="block must be a positive integer"):
        tiled_attention(q, q, q, 0)
    with pytest.raises(ValueError, match="one shape"):
        tiled_attention(q, q[:, :, :4], q)
    with pytest.raises(ValueError, match="attention must be"):
        GPTConfig(attention="flash")
    with pytest.raises(ValueError, match="no attention dropout"):
        GPTConfig(attention="tiled", dropout=0.1)


def _saved_by_one_layer(attention: str, B: int, S: int, block: int = 128) -> int:
    torch.manual_seed(0)
    layer = CausalSelfAttention(GPTConfig(n_head=4, n_embd=32, block_size=S, attention=attention, attn_block=block))
    x = torch.randn(B, S, 32, requires_grad=True)
    with Ledger(layer) as led:
        y = layer(x)
        y.sum().backward()
    return led.measurement().saved


def test_ledger_one_layer_loses_the_s2_term():
    """At B=2, a=4, S=256, h=32, fp32 one attention layer saves, measured by the ledger: manual 2,490,376 B,
    tiled 335,880 B (SDPA's fused kernel: the same). The difference is exactly what the manual path keeps of
    size S x S: the probabilities (B a S^2 x 4 = 2,097,152) and the ~mask (S^2 bools = 65,536), less the
    tiled path's logsumexp (B a S x 4 = 8,192). Both keep q, k, v (3 B S h x 4: the manual path's contiguous
    copies, the tiled path's c_attn output they are views of), B S h x 4 for c_proj (the manual path's
    contiguous copy of the output, the tiled path's output itself, laid out so that copy is a view) and the
    layer's output. At S=512: manual 9,306,120 B, tiled 671,752 B: the tiled layer grows with S, not S^2."""
    B, S, a, h = 2, 256, 4, 32
    manual, tiled, sdpa = (_saved_by_one_layer(kind, B, S) for kind in ("manual", "tiled", "sdpa"))
    assert manual - tiled == B * a * S * S * 4 + S * S - B * a * S * 4 == 2_154_496
    assert tiled == sdpa  # what a fused kernel saves: q, k, v (the c_attn output), out and the logsumexp
    linear = 5 * B * S * h * 4  # q, k, v, the attention output and the layer's output: what grows with S
    assert _saved_by_one_layer("tiled", B, 2 * S) - tiled == linear + B * a * S * 4  # + the logsumexp
    assert _saved_by_one_layer("manual", B, 2 * S) - manual == linear + 3 * (B * a * S * S * 4 + S * S)


def test_gpt_tiled_matches_sdpa_gpt():
    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_head=2, n_embd=32, block_size=48, vocab_size=50)
    a, b = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, attention="tiled", attn_block=16))
    b.load_state_dict(a.state_dict())
    x, y = torch.randint(0, 50, (3, 40)), torch.randint(0, 50, (3, 40))
    la, lb = a(x, y), b(x, y)
    la.backward(), lb.backward()
    # only the attention differs: each of its entries within 2 S ulps (test_fp32_equals_sdpa), and what
    # follows sums at most n_layer x (S + 5 h) + V more terms
    K = 2 * (40 + 5 * 32) + 50
    assert (la - lb).abs().item() <= K * EPS32 * la.item()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad - q.grad).abs().max() <= K * EPS32 * p.grad.abs().max(), n


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,S,D,block", [(1, 2, 50, 16, 16), (2, 2, 40, 8, 64), (3, 2, 45, 8, 16)])
def test_scratch_bytes_is_what_the_ledger_sees(dtype, B, H, S, D, block, packed):
    """The estimator's formula (tiled_attention.scratch_bytes) against one call under the ledger: the forward's
    peak less the output and the logsumexp; the backward's less those and the three fp32 accumulators.
    packed: q, k, v are views of one (B, S, 3 H D) tensor and the output's gradient is (B, S, H, D) transposed,
    as in the model (CausalSelfAttention): with B and H over 1 an fp32 matmul copies such a tile."""
    from labkit.recompute.tiled_attention import scratch_bytes

    if packed:
        qkv = torch.randn(B, S, 3 * H * D, dtype=dtype, requires_grad=True)
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
        g = torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2)
    else:
        q, k, v = (torch.randn(B, H, S, D, dtype=dtype, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, S, D, dtype=dtype)
    with Ledger() as led:
        torch.autograd.grad(tiled_attention(q, k, v, block), (q, k, v), g)  # only the Function's backward runs
    m = led.measurement()
    n, kept = B * H * S * D, B * H * S * D * q.element_size() + B * H * S * 4
    assert (m.phases["forward"].total - kept, m.phases["backward"].total - kept - 3 * n * 4) == \
        scratch_bytes(B, H, S, D, block, q.element_size(), packed=packed and B > 1 and H > 1)


@pytest.mark.parametrize("policy,kept", [("matmuls", 1), ("attention-core", 0)])
def test_selective_sees_one_op_not_the_tiles(policy, kept):
    """Under selective checkpointing's forward mode the attention is one op, whose (out, logsumexp) the policy
    keeps or not: no tile's scores are cached (16 tiles here), and the gradients are those of a plain call."""
    from labkit.recompute.selective import selective_checkpoint, selective_contexts

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8, requires_grad=True) for _ in range(3))
    keep, _ = selective_contexts(policy)
    with keep:
        tiled_attention(q.detach(), k.detach(), v.detach(), 8)
    assert {str(op): len(c) for op, c in keep.cache.items() if c} == ({"labkit.tiled_attention.default": 1} if kept else {})
    g = torch.randn(1, 2, 32, 8)
    ref = torch.autograd.grad(tiled_attention(q, k, v, 8), (q, k, v), g)
    got = torch.autograd.grad(selective_checkpoint(tiled_attention, q, k, v, 8, policy=policy), (q, k, v), g)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ledger_sees_inside_the_op_what_a_direct_call_makes(dtype):
    """count_inside: the op's body runs under the ledger as from user code, so a composite op in it (matmul of the
    model's q, k, v views) shows the copy it makes; the op's forward and backward peaks equal a direct call's."""
    from labkit.memory import Ledger
    from labkit.recompute import tiled_attention as ta

    B, H, S, D = 2, 2, 40, 8
    qkv = torch.randn(B, S, 3 * H * D, dtype=dtype)
    q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
    g = torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2)

    def peak(fn):
        with Ledger() as led, torch.no_grad():
            fn()
        return led.measurement().peak.total

    fwd = torch.ops.labkit.tiled_attention
    assert peak(lambda: fwd(q, k, v, 16, 0.3)) == peak(lambda: ta._forward(q, k, v, 16, 0.3))
    out, lse = ta._forward(q, k, v, 16, 0.3)
    bwd = torch.ops.labkit.tiled_attention_backward
    assert peak(lambda: bwd(g, q, k, v, out, lse, 16, 0.3)) == peak(lambda: ta._backward(g, q, k, v, out, lse, 16, 0.3))
