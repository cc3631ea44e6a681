"""The chunked output loss (labkit.recompute.chunked_output): parity with torchtune's
CEWithChunkedOutputLoss and F.cross_entropy, and the Recipe field that runs it (Recipe.loss_chunks).
"""

import importlib.util
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F

from estimate_checks import assert_categories_within, assert_every_phase_within, assert_phases_within
from labkit.cli import main
from labkit.estimate import Recipe, estimate
from labkit.memory import TermKey
from labkit.models.gpt import GPT, GPTConfig
from labkit.recompute.chunked_output import chunked_output_loss, output_chunks
from labkit.run import measure_step


def _torchtune_loss():
    """torchtune's CEWithChunkedOutputLoss: imported, or (torchtune installed without its torchao
    dependency, whose absence its package __init__ refuses) loaded from its own file, plain torch.
    """
    try:
        from torchtune.modules.loss import CEWithChunkedOutputLoss

        return CEWithChunkedOutputLoss
    except ImportError:
        spec = importlib.util.find_spec("torchtune")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("torchtune is not installed (pip install --no-deps torchtune==0.6.1)")
        root = pathlib.Path(spec.submodule_search_locations[0])
        path = root / "modules" / "loss" / "ce_chunked_output_loss.py"
        if not path.exists():
            pytest.skip(f"torchtune is installed without {path.name}")
        mod_spec = importlib.util.spec_from_file_location("torchtune_ce_chunked_output_loss", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        return mod.CEWithChunkedOutputLoss


def _case(B=3, S=20, h=16, V=50, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, h, generator=g, dtype=dtype)
    head = torch.nn.Linear(h, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, h, generator=g) * 0.3)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = -100  # ignored targets
    labels[2, -3:] = -100
    return hidden.requires_grad_(True), head, labels


def _loss_and_grads(loss_fn, hidden, head, labels, chunks):
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    loss = loss_fn(output_chunks(hidden, head, chunks), labels)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), head.weight.grad.clone()


@pytest.mark.parity
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_loss_and_gradients_match_torchtune(chunks):
    """The same loss and gradients (hidden states and head weight) as torchtune's loss on the same
    chunks, and as F.cross_entropy on whole logits: fp32 sums in another order, so to fp32 rounding.
    """
    tt = _torchtune_loss()(num_output_chunks=chunks)
    hidden, head, labels = _case()
    ours = _loss_and_grads(chunked_output_loss, hidden, head, labels, chunks)
    theirs = _loss_and_grads(tt, hidden, head, labels, chunks)
    def whole(z, y):
        return F.cross_entropy(torch.cat(z, 1).flatten(0, 1), y.flatten())

    plain = _loss_and_grads(whole, hidden, head, labels, 1)
    for a, b, c in zip(ours, theirs, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parity
def test_bf16_logits_upcast_per_chunk_match_torchtune():
    """bf16 hidden states and head: each chunk is upcast to fp32 before its loss, as torchtune's."""
    tt = _torchtune_loss()(num_output_chunks=4)
    hidden, head, labels = _case(dtype=torch.bfloat16, S=16)
    ours = _loss_and_grads(chunked_output_loss, hidden, head, labels, 4)
    theirs = _loss_and_grads(tt, hidden, head, labels, 4)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-5)  # bf16's 8-bit mantissa


def test_gpt_output_chunks_give_its_own_loss():
    """labkit GPT's forward with output_chunks: the chunks' loss equals its own F.cross_entropy."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=40))
    x, y = torch.randint(0, 40, (2, 16)), torch.randint(0, 40, (2, 16))
    torch.testing.assert_close(chunked_output_loss(m(x, output_chunks=3), y), m(x, y),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="targets"):
        m(x, y, output_chunks=3)


def test_recipe_checks_loss_chunks():
    assert Recipe("gpt2-tiny", 2, 16).loss_chunks is None
    assert Recipe("gpt2-tiny", 2, 16, loss_chunks=8).loss_chunks == 8
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="loss_chunks must be a positive integer"):
            Recipe("gpt2-tiny", 2, 16, loss_chunks=bad)
    with pytest.raises(ValueError, match="cannot exceed seq"):
        Recipe("gpt2-tiny", 2, 16, loss_chunks=17)
    with pytest.raises(ValueError, match="two chunked losses"):
        Recipe(GPTConfig(loss_chunk=64), 2, 16, loss_chunks=8)
    with pytest.raises(ValueError, match="two chunked losses"):
        Recipe.of(GPTConfig(), 2, 16, loss_chunks=8, loss_chunk=32)
    Recipe.of(GPTConfig(loss_chunk=64), 2, 16, loss_chunks=8, loss_chunk=0)  # the override: off


# ---- the estimate against the ledger (output_chunks_loss, predict._output_chunk_fields) ----
# vocabulary 2048 on the tiny presets (their own is 256), so that the loss is the largest thing in
# the step, as a 128k vocabulary makes it on a 3B model
TINY = {"labkit-gpt": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=2048),
        "gpt2-tiny": "gpt2-tiny", "llama-tiny": "llama-tiny"}
# every family with each precision and each policy, and each precision with each policy (6 of the 12 runs)
FAMILY_CASES = [("labkit-gpt", "fp32", "none"), ("labkit-gpt", "mixed-bf16", "full"),
                ("gpt2-tiny", "fp32", "full"), ("gpt2-tiny", "mixed-bf16", "none"),
                ("llama-tiny", "fp32", "none"), ("llama-tiny", "mixed-bf16", "full")]


def _recipe(family, B=4, S=64, **kw):
    if family != "labkit-gpt":
        kw.setdefault("vocab_size", 2048)
    return Recipe.of(TINY[family], B, S, **kw)


@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: "-".join(c))
def test_chunked_loss_predicted_per_category_within_3_percent(case):
    family, dtype, checkpoint = case
    r = _recipe(family, dtype=dtype, checkpoint=checkpoint, loss_chunks=4)
    e, m = estimate(r), measure_step(r, steps=2)
    assert "loss_chunks=4" in e.label and "loss_chunks=4" in m.label
    assert_categories_within(e, m)
    assert_phases_within(e, m)


@pytest.mark.parametrize("family,B,S,kw", [
    ("llama-tiny", 4, 64, dict(dtype="mixed-bf16", loss_chunks=5)),  # 13 tokens, the last 12
    ("llama-tiny", 4, 10, dict(dtype="mixed-bf16", loss_chunks=4)),  # 3, 3, 3, 1 tokens
    ("llama-tiny", 1, 64, dict(dtype="fp32", loss_chunks=4)),  # one row: views, not copies
    ("llama-tiny", 4, 64, dict(dtype="fp32", loss_chunks=8, vocab_size=8192, optimizer="sgd")),
    ("gpt2-tiny", 4, 64, dict(dtype="bf16", loss_chunks=8, optimizer="sgd", micro_batch=2)),
    ("llama-tiny", 4, 64, dict(dtype="mixed-bf16", loss_chunks=4, lora_rank=8)),
    # activation offload: each chunk's log-softmax leaves the device when its loss returns
    ("gpt2-tiny", 4, 64, dict(dtype="mixed-bf16", loss_chunks=4, offload_activations=True)),
    ("llama-tiny", 4, 64, dict(dtype="fp32", loss_chunks=4, offload_activations=True)),
    ("labkit-gpt", 4, 64, dict(dtype="mixed-bf16", loss_chunks=4, offload_activations=True,
                               checkpoint="full")),
])
def test_chunked_loss_other_shapes_within_3_percent(family, B, S, kw):
    r = _recipe(family, B, S, **kw)
    e, m = estimate(r), measure_step(r, steps=2)
    assert_categories_within(e, m)
    assert_phases_within(e, m)


# the presets' own 256-token vocabulary, where the chunks' saved inputs (r x h) are a visible share of the head's
# backward: B = 2 makes each chunk a strided view, which matmul's reshape copies (fp32), as autocast's cast does
SMALL_VOCAB = {"labkit-gpt": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256),
               "gpt2-tiny": "gpt2-tiny", "llama-tiny": "llama-tiny"}


@pytest.mark.parametrize("family", list(SMALL_VOCAB))
@pytest.mark.parametrize("chunks,dtype,sib", [(2, "fp32", False), (3, "fp32", True), (3, "mixed-bf16", False)])
def test_each_chunks_saved_input_is_freed_with_its_matmul(family, chunks, dtype, sib):
    """Each chunk's head matmul saves its own copy of its input and frees it when its node returns: at the
    head's worst chunk the chunks done are gone, after the last all of them (the old estimate kept them:
    activations 5.6 % of the peak over at llama-tiny, fp32, 2 chunks). Every phase's every category, step in
    backward's head step included (the chunks' dX beside the summed dW, nothing else of the head's)."""
    kw = dict(n_layer=2, attn_implementation="eager") if family == "gpt2-tiny" else \
        dict(num_hidden_layers=2) if family == "llama-tiny" else {}
    r = Recipe.of(SMALL_VOCAB[family], 2, 48, dtype=dtype, optimizer="sgd", loss_chunks=chunks,
                  step_in_backward=sib, **kw)
    e, m = estimate(r), measure_step(r, steps=2)
    assert_every_phase_within(e, m, 0.002)


@pytest.mark.parametrize("family", ["labkit-gpt", "gpt2-tiny"])
def test_a_later_micro_batch_frees_the_heads_copy_before_the_chunks_last_sum(family):
    """Under autocast every chunk's matmul saves the head's 16-bit weight copy: when the last one returns the
    copy is freed, before autograd's buffer sums that chunk's dW with the others (three V x h tensors). The
    old estimate kept the copy there: on a later micro-batch that sum was the backward's peak, 1.50 % of it
    in parameters over (random bench seed 1, config 53)."""
    kw = dict(n_layer=2, attn_implementation="eager") if family == "gpt2-tiny" else {}
    r = Recipe.of(SMALL_VOCAB[family], 8, 2, dtype="mixed-fp16", optimizer="sgd-momentum", micro_batch=4,
                  loss_chunks=2, **kw)
    e, m = estimate(r), measure_step(r, steps=2)
    assert_every_phase_within(e, m, 0.002)


@pytest.mark.parametrize("case", ["gpt-8-chunks", "llama-tie"])
def test_at_the_worst_chunks_loss_the_later_chunks_have_no_log_softmax_yet(case):
    """16-bit logits, 8 chunks of 9 tokens but the last of 4: the forward's worst moment is the last 9-token
    chunk's loss (its fp32 copy beside the log-softmax so far). The chunk after it has made no log-softmax
    yet: that is activations the estimate counted before (+1.16 % of the peak, random bench seed 2 #59), not
    temporaries. Chunks of 2, 2 and 1 tokens tie (the second's copy less the third's log-softmax, the third's
    copy): the later one is the moment, the earlier losses' scalars beside it (seed 11 #30: 3.75 % of the
    peak between the two categories)."""
    if case == "llama-tie":
        r = Recipe.of("llama-tiny", 5, 5, dtype="bf16", optimizer="adafactor", loss_chunks=3, num_hidden_layers=1,
                      hidden_size=32, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                      lora_rank=1, quant="int8")
        e, m = estimate(r), measure_step(r, steps=2)
        assert_every_phase_within(e, m, 0.002)
        return
    model = GPTConfig(n_layer=1, n_head=8, n_embd=64, block_size=128, vocab_size=256, attention="manual")
    r = Recipe.of(model, 8, 67, dtype="fp16", optimizer="adafactor", loss_chunks=8)
    e, m = estimate(r), measure_step(r, steps=2)
    assert_every_phase_within(e, m, 0.002)


def test_chunks_take_the_fp32_copy_and_the_loss_gradients_apart():
    """Under mixed-bf16 the plain loss holds all logits' fp32 copy (r V 4) at the loss and, in
    backward, the loss's gradients over all logits (2 r V 4); the chunked one holds one chunk's copy
    and one chunk's gradients (plus the 16-bit dlogits of the chunks before): the peak drops, the
    saved log-softmax stays."""
    plain, chunked = (estimate(_recipe("llama-tiny", dtype="mixed-bf16", loss_chunks=n))
                      for n in (None, 8))
    r, V = 4 * 64, 2048

    def term(e, key):
        return next(t.bytes for t in e.terms if t.key is key)

    assert term(plain, TermKey.LOG_SOFTMAX) == term(chunked, TermKey.LOG_SOFTMAX) == r * V * 4
    assert term(plain, TermKey.LOGITS) == r * V * (2 + 4)
    assert term(chunked, TermKey.LOGITS) == r * V * 2 + (r // 8) * V * 4
    assert chunked.peak.total < plain.peak.total


def test_llama32_3b_lora_peak_drops_by_the_loss_temporaries_less_what_the_chunks_keep(capsys):
    """Issue 43's case: Llama-3.2-3B (28 layers, 3072 wide, 24 heads, 8 kv heads, FFN 8192,
    vocabulary 128,256, tied), batch 2 x 4096, bf16 (torchtune's LoRA recipes' dtype), CUDA, full
    checkpointing, LoRA r=64 on q, v, o and the MLP. The plain loss peaks at its backward's start:
    the saved log-softmax (r V 4) and the loss's gradients over all logits (2 r V 4). With 8 chunks
    the peak moves to the loss's forward and holds what the chunks keep: every chunk's bf16 logits
    (torchtune's model returns them all: r V 2) and one chunk's fp32 copy (r V 4 / 8); the
    log-softmax stays saved (each chunk's, r V 4 in all)."""
    kw = dict(dtype="bf16", device="cuda", checkpoint="full", lora_rank=64,
              lora_targets="q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    plain = estimate(Recipe.of("llama3.2-3b", 2, 4096, **kw))
    chunked = estimate(Recipe.of("llama3.2-3b", 2, 4096, loss_chunks=8, **kw))
    r, V, GiB = 2 * 4096, 128256, 2**30
    loss_keys = (TermKey.LOGITS, TermKey.LOSS_TEMPS)

    def loss_temps(e):
        return sum(t.bytes for t in e.peak_moment.terms if t.key in loss_keys)

    temps, kept = loss_temps(plain), loss_temps(chunked)
    lsm = sum(t.bytes for t in plain.peak_moment.terms if t.key is TermKey.LOG_SOFTMAX)
    drop = plain.peak.total - chunked.peak.total
    with capsys.disabled():
        print(f"\nLlama-3.2-3B LoRA r=64, B=2 S=4096 bf16, checkpoint full: peak "
              f"{plain.peak.total / GiB:.2f} GiB plain ({plain.peak_moment.where}), "
              f"{chunked.peak.total / GiB:.2f} GiB with loss_chunks=8 "
              f"({chunked.peak_moment.where}); "
              f"the loss's temporaries {temps / GiB:.2f} GiB (+ its saved "
              f"log-softmax {lsm / GiB:.2f} GiB), what the chunks keep {kept / GiB:.2f} GiB; drop "
              f"{drop / GiB:.2f} GiB = {100 * drop / temps:.1f} % of the temporaries")
    assert lsm == r * V * 4 and temps == 2 * r * V * 4  # the 3.91 + 7.83 GiB
    assert kept == r * V * 2 + r // 8 * V * 4
    # the rest of the two peaks differs by a few token-sized tensors only: the plain loss's shifted
    # labels and the chunks' label copies (r x 8 each), the checkpointed regions' other arguments
    # so the drop is 1 - (2 + 4/8) / 8 = 68.75 % of the temporaries: the chunks' bf16 logits live on
    assert abs(drop - (temps - kept)) <= r * 8


# ---- the command line and the planner ----------------------------------------------------------


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_and_wall_take_loss_chunks(capsys):
    tiny = ["--model", "llama-tiny", "--batch", "4", "--seq", "64"]
    plain = _json(capsys, "estimate", *tiny, "--json")
    chunked = _json(capsys, "estimate", *tiny, "--json", "--loss-chunks", "8")
    assert chunked["options"]["loss_chunks"] == 8 and plain["options"]["loss_chunks"] is None
    assert chunked["peak"] < plain["peak"]
    wall = ["wall", "--models", "llama-tiny", "--seq", "64", "--batch", "4"]
    walls = [_json(capsys, *wall, "--json", *extra) for extra in ((), ("--loss-chunks", "8"))]
    assert walls[1]["loss_chunks"] == 8 and "loss in 8 chunks" in walls[1]["recipe"]
    assert all(a["peak"] > b["peak"] for a, b in zip(walls[0]["rows"], walls[1]["rows"]))
    for argv, words in (
            (["estimate", *tiny, "--loss-chunks", "0"], "--loss-chunks must be a positive integer"),
            (["estimate", *tiny[:4], "--seq", "6", "--loss-chunks", "8"], "cannot exceed seq"),
            (["estimate", "--model", "gpt:loss_chunk=16", *tiny[2:], "--loss-chunks", "8"],
             "two chunked losses"),
            ([*wall, "--loss-chunks", "-1"], "--loss-chunks")):
        assert main(argv) == 2
        assert words in capsys.readouterr().err


def test_plan_searches_the_chunked_loss(capsys):
    """One row of 64 tokens, a vocabulary of 8192: only 8 chunks (with the optimizer on the host)
    fit 7 MB."""
    gpt = "gpt:n_layer=2,n_head=2,n_embd=32,block_size=64,vocab_size=8192"
    out = _json(capsys, "plan", "--model", gpt, "--memory", "7MB", "--batch", "1", "--seq", "64",
                "--top", "1", "--device-preset", "cpu", "--json")
    best = out["plans"][0]
    assert best["recipe"]["loss_chunks"] == 8 and "loss in 8 chunks" in best["summary"]
    needed = "chunked loss: 8 chunks along the sequence: needed"
    assert any(w.startswith(needed) for w in best["why"])


def test_qlora_with_chunked_loss_counts_the_frozen_heads_copies_once():
    """The random bench, seed 9, configuration 22: under QLoRA the frozen (tied) head's autocast copy is made
    and saved by each chunk's matmul; those copies were also counted among the blocks' (forward parameters
    +3.09 % of the peak)."""
    from estimate_checks import estimate_and_measure
    from labkit.models.gpt import GPTConfig

    model = GPTConfig(n_layer=4, n_head=1, n_embd=64, block_size=64, dropout=0.1)
    r = Recipe.of(model, 7, 3, device="cpu", dtype="mixed-bf16", optimizer="sgd-momentum", lora_rank=8,
                  quant="nf4", loss_chunks=2, quant_set="targets")
    estimate_and_measure(r, tol=0.005)
