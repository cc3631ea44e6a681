"""labkit.recompute against torch.utils.checkpoint and against the Ledger's and FlopCounterMode's counts."""

import contextlib
import os
from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from labkit.models.gpt import GPT, GPTConfig
from labkit.recompute import (SelectivePolicy, blocks_forward_flops, checkpoint, checkpoint_blocks, checkpoint_reentrant,
                              compare_compiled, offload_activations, segment_bounds, selective_checkpoint,
                              sqrt_segments, torch_policy, try_compile)
from labkit.recompute import activations as act
from labkit.recompute.segments import best_segments
from labkit.run import measure_training_step

B, T, C = 2, 32, 32
X_BYTES = B * T * C * 4  # one block input, fp32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: one thread is much faster than two fighting on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gpt(n_layer=2, attention="sdpa", dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=C, block_size=T, attention=attention, dropout=dropout,
                         attn_block=8))  # tiled attention: 4 x 4 tiles at T = 32


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)


class _wrap_blocks:
    """Run every block through wrap(forward, x) for the duration of a with block."""

    def __init__(self, model, wrap):
        self.model = model
        for b in model.blocks:
            b.forward = partial(wrap, b.forward)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for b in self.model.blocks:
            del b.forward


def _torch_full(model):
    return _wrap_blocks(model, lambda f, x: torch_checkpoint(f, x, use_reentrant=False))


def _torch_sac(model, policy):
    ctx = partial(create_selective_checkpoint_contexts, torch_policy(policy))
    return _wrap_blocks(model, lambda f, x: torch_checkpoint(f, x, use_reentrant=False, context_fn=ctx))


def _step(model, x, y, ctx=None):
    """Loss, parameter gradients and the next random number after one forward/backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    with ctx or contextlib.nullcontext():
        loss = model(x, y)
        loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], torch.rand(1).item()


def _max_diff(ga, gb):
    return max((a - b).abs().max().item() for a, b in zip(ga, gb))


# ---- 1. full checkpointing, both styles ------------------------------------------------------------
@pytest.mark.parametrize("attention,dropout", [("sdpa", 0.0), ("sdpa", 0.1), ("manual", 0.1)])
@pytest.mark.parity
def test_both_styles_match_torch_and_no_checkpointing(attention, dropout):
    m, (x, y) = _gpt(2, attention, dropout), _data()
    ref = _step(m, x, y)
    runs = {
        "torch non-reentrant": _step(m, x, y, _torch_full(m)),
        "hooks": _step(m, x, y, checkpoint_blocks(m, "full")),
        "reentrant": _step(m, x, y, checkpoint_blocks(m, "full", style="reentrant")),
    }
    for name, (loss, grads, next_rand) in runs.items():
        assert loss == ref[0], name
        assert _max_diff(grads, ref[1]) <= 1e-6, name  # exact in practice: the recompute replays the RNG
        assert next_rand == ref[2], name  # the caller's RNG stream is left as without checkpointing


@pytest.mark.parity
def test_function_level_checkpoint():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)  # does not require grad

    def f(a, scale=1.0):
        return (torch.tanh(a @ w) * scale).sum()

    ref = torch.autograd.grad(f(x, scale=2.0), w)[0]
    assert torch.equal(torch.autograd.grad(checkpoint(f, x, scale=2.0), w)[0], ref)  # kwargs, autograd.grad
    with pytest.raises(ValueError, match="args"):  # the reentrant style needs an input that requires grad
        checkpoint_reentrant(f, x)
    xg = x.clone().requires_grad_()
    checkpoint_reentrant(f, xg).backward()
    assert torch.allclose(w.grad, ref / 2.0, atol=1e-6) and xg.grad is not None


def test_nondeterministic_region_is_detected():
    calls = []

    def f(a):
        calls.append(1)
        return torch.exp(a).sum() if len(calls) == 1 else (torch.exp(a) * torch.sin(a)).sum()

    with pytest.raises(RuntimeError, match="not deterministic"):
        checkpoint(f, torch.randn(4, requires_grad=True)).backward()


# ---- 2. segments: memory as the formula says, FLOPs exactly one more forward --------------------------
def test_segments_memory_and_flops():
    n = 4
    m, (x, y) = _gpt(n), _data()
    none = measure_training_step(m, x, y, "none")
    rows = {k: measure_training_step(m, x, y, f"k={k}", partial(checkpoint_blocks, policy="full", segments=k))
            for k in (1, 2, 4)}
    block = (none.saved - rows[n].saved) // n + X_BYTES  # one block's saved activations, input included
    for k, r in rows.items():
        assert r.saved == rows[1].saved + (k - 1) * X_BYTES  # each segment keeps only its input
        # the recomputed segment's n/k blocks of activations appear, as temporaries, during backward
        assert abs(r.temp_at_peak - rows[n].temp_at_peak - (n // k - 1) * block) <= 0.02 * block
    assert none.saved - rows[n].saved == n * (block - X_BYTES)
    # FLOPs: exactly one extra forward of the checkpointed blocks, whatever k
    extra = blocks_forward_flops(m, x)
    assert extra > 0
    for r in rows.values():
        assert r.flops - none.flops == extra
    last_kept = measure_training_step(m, x, y, "keep last", partial(checkpoint_blocks, policy="full", segments=2, keep_last=True))
    assert last_kept.flops - none.flops == extra // 2  # like checkpoint_sequential: the last segment is not redone


def test_segment_choices_and_reversibility():
    assert segment_bounds(8, 3) == [(0, 2), (2, 5), (5, 8)]
    assert [sqrt_segments(n) for n in (1, 4, 8, 9, 16)] == [1, 2, 3, 3, 4]
    assert best_segments(8, block_bytes=16, input_bytes=1) == 8  # a transformer block: per-block is best
    assert best_segments(16, block_bytes=1, input_bytes=1) == 4  # Chen's equal-cost layers: sqrt(n)
    m, (x, y) = _gpt(3), _data()
    keys = list(m.state_dict())
    ref = m(x, y)
    with checkpoint_blocks(m, "sqrt") as h:
        assert h.segments == 2 and h.bounds == [(0, 1), (1, 3)]
        assert list(m.state_dict()) == keys
        assert torch.equal(m(x, y), ref)
    assert all("forward" not in b.__dict__ for b in m.blocks)
    checkpoint_blocks(m, "full").remove()
    assert all("forward" not in b.__dict__ for b in m.blocks)


# ---- 3. selective checkpointing --------------------------------------------------------------------------
@pytest.mark.parametrize("attention,dropout", [("sdpa", 0.0), ("manual", 0.1), ("tiled", 0.0)])
@pytest.mark.parametrize("policy", ["matmuls", "attention-core"])
@pytest.mark.parity
def test_selective_matches_torch_sac(policy, attention, dropout):
    m, (x, y) = _gpt(2, attention, dropout), _data()
    ref = _step(m, x, y)
    ours = _step(m, x, y, checkpoint_blocks(m, "selective", selective=policy))
    theirs = _step(m, x, y, _torch_sac(m, policy))
    assert ours[0] == theirs[0] == ref[0]
    assert _max_diff(ours[1], theirs[1]) <= 1e-6 and _max_diff(ours[1], ref[1]) <= 1e-6
    fig = {name: measure_training_step(m, x, y, name, setup) for name, setup in {
        "none": None, "full": partial(checkpoint_blocks, policy="full"),
        "ours": partial(checkpoint_blocks, policy="selective", selective=policy),
        "torch": partial(_torch_sac, policy=policy)}.items()}
    assert fig["ours"].saved == fig["torch"].saved  # the same tensors kept
    assert fig["ours"].flops == fig["torch"].flops  # the same ops recomputed
    assert fig["full"].saved < fig["ours"].saved <= fig["none"].saved
    assert fig["none"].flops <= fig["ours"].flops < fig["full"].flops
    if attention == "manual":  # the s x s scores are what selective recompute is for
        assert fig["ours"].saved < 0.8 * fig["none"].saved
    if attention == "tiled":  # one op to the policy: its (out, logsumexp) kept or the whole call re-run, no tiles
        assert fig["none"].flops < fig["ours"].flops if policy == "attention-core" else fig["none"].flops == fig["ours"].flops


@pytest.mark.parity
def test_selective_policy_sets_and_function_level():
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)

    def f(a):
        return torch.relu(a @ w) @ w

    ref = torch.autograd.grad(f(x).sum(), (x, w))
    got = torch.autograd.grad(selective_checkpoint(f, x, policy={torch.ops.aten.mm}).sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    pol = SelectivePolicy.of({torch.ops.aten.mm.default})
    assert pol.keeps(torch.ops.aten.mm.default) and not pol.keeps(torch.ops.aten.relu.default)
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.zeros(1, 1, 2, 2)
    assert SelectivePolicy.of("matmuls").keeps(sdpa, (q, q, q, 0.0))
    assert not SelectivePolicy.of("matmuls").keeps(sdpa, (q, q, q, 0.1))  # random: always recomputed


# ---- 4. offload --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention,dropout", [("sdpa", 0.0), ("manual", 0.1)])
@pytest.mark.parity
def test_offload_gradients_and_memory(attention, dropout):
    m, (x, y) = _gpt(2, attention, dropout), _data()
    ref = _step(m, x, y)
    got = _step(m, x, y, offload_activations())
    assert got[0] == ref[0] and _max_diff(got[1], ref[1]) <= 1e-6
    hooks = {}

    def setup(model, **kw):
        hooks["h"] = offload_activations(**kw)
        return hooks["h"]

    none = measure_training_step(m, x, y, "none")
    off = measure_training_step(m, x, y, "offload", setup)
    stats = hooks["h"].stats
    outside = x.nbytes + y.nbytes  # token ids made before the Ledger started: offloaded, never counted
    assert stats.parameters > 0 and stats.offloaded > 0
    assert none.saved - off.saved == stats.offloaded - outside
    assert abs((none.act_at_peak - off.act_at_peak) - (stats.offloaded - outside)) <= 64
    assert off.backward_peak < none.backward_peak
    small = measure_training_step(m, x, y, "threshold", partial(setup, min_bytes=X_BYTES + 1))
    assert hooks["h"].stats.kept > 0 and small.saved > off.saved  # tensors under min_bytes stay


# ---- 5. memory-efficient activations ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(act.ACTIVATIONS))
@pytest.mark.parity
def test_activation_functions(name):
    naive, lean = act.ACTIVATIONS[name]
    x64 = torch.randn(32, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lean, (x64,))
    x = (torch.randn(4096) * 3).requires_grad_()
    g_naive, = torch.autograd.grad(naive(x).sum(), x)
    g_lean, = torch.autograd.grad(lean(x).sum(), x)
    assert (g_naive - g_lean).abs().max().item() <= 1e-6
    torch_ref = {"silu": torch.nn.functional.silu, "gelu-tanh": partial(torch.nn.functional.gelu, approximate="tanh")}[name]
    assert torch.allclose(lean(x), torch_ref(x), atol=1e-6)
    shape = (4, 8, 16)
    size = 4 * 8 * 16 * 4
    kept_naive, kept_lean = act.saved_activation_bytes(naive, shape), act.saved_activation_bytes(lean, shape)
    assert kept_lean == 0  # only the input, which the previous op made anyway
    assert kept_naive // size == {"silu": 1, "gelu-tanh": 3}[name]  # sigmoid(x); tanh, 0.5x, 1+tanh


# ---- 6. fusion -------------------------------------------------------------------------------------------------
def test_try_compile_is_opt_in_and_fails_softly(capsys, monkeypatch):
    monkeypatch.delenv("LABKIT_COMPILE", raising=False)
    mod = torch.nn.GELU()
    assert try_compile(mod) is mod
    assert "opt-in" in capsys.readouterr().out
    assert try_compile(mod, enable=True, backend="no-such-backend") is mod
    out = capsys.readouterr().out
    assert out.startswith("try_compile: running eagerly") and out.count("\n") == 1


def test_compiled_chain_saves_less():
    """aot_eager_decomp_partition: dynamo and AOT autograd's partitioner, no C++ compiler, so it runs
    wherever torch.compile does (compare_compiled raises with the reason where it does not)."""
    fig = compare_compiled(shape=(16, 64))
    assert fig.eager >= 4 * fig.input_bytes  # eager keeps several tensors of the input's size
    assert fig.compiled < fig.input_bytes  # the partitioner keeps only the input and recomputes
    assert fig.compiled_graph <= fig.input_bytes < fig.eager_graph


@pytest.mark.skipif(os.environ.get("LABKIT_COMPILE") != "1",
                    reason="inductor compiles C++ for ~30-60 s on CPU: opt in with LABKIT_COMPILE=1")
def test_inductor_chain_saves_less():
    fig = compare_compiled(shape=(16, 64), backend="inductor")
    assert fig.compiled_graph <= fig.input_bytes < fig.eager_graph


# ---- 8. bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call,arg", [
    (lambda m: checkpoint_blocks(m, "full", segments=0), "segments"),
    (lambda m: checkpoint_blocks(m, "full", segments=3), "segments"),
    (lambda m: checkpoint_blocks(m, "full", segments=1.5), "segments"),
    (lambda m: checkpoint_blocks(m, "sqrt", segments=1), "segments"),
    (lambda m: checkpoint_blocks(m, "everything"), "policy"),
    (lambda m: checkpoint_blocks(m, "full", style="magic"), "style"),
    (lambda m: checkpoint_blocks(m, "selective", style="reentrant"), "style"),
    (lambda m: checkpoint_blocks(m, "selective", selective="softmax-only"), "policy"),
    (lambda m: checkpoint_blocks(torch.nn.Linear(2, 2), "full"), "model"),
    (lambda m: SelectivePolicy.of({"mm"}), "policy"),
    (lambda m: offload_activations(min_bytes=-1), "min_bytes"),
])
def test_bad_input_names_the_argument(call, arg):
    with pytest.raises(ValueError) as e:
        call(_gpt(2))
    msg = str(e.value)
    assert msg.startswith(arg) and "\n" not in msg


def test_double_checkpointing_and_cuda_only_features():
    m = _gpt(2)
    with checkpoint_blocks(m, "full"):
        with pytest.raises(ValueError, match="already checkpointed"):
            checkpoint_blocks(m, "sqrt")
    if not torch.cuda.is_available():
        for kw in ("pin_memory", "use_stream"):
            with pytest.raises(ValueError, match=f"{kw}=True needs CUDA"):
                offload_activations(**{kw: True})
