"""A shape-only forward pass that records what autograd saves for backward: the activation terms.

Each primitive below says, in its docstring, which tensors PyTorch's autograd keeps for the backward
pass (the rules of `tools/autograd/derivatives.yaml`) and so how many bytes it adds. A tensor saved
by two ops (a LayerNorm's output read by three projections) is counted once, as in memory. Model
families are written as short sequences of primitives in `labkit.estimate.families`.

Frozen weights (LoRA, QLoRA, LISA) change what is saved: autograd saves an op's input only for the
gradients it must compute, so a frozen Linear keeps nothing of x, and nothing is recorded at all
before the first tensor that requires grad (`T.rg`). `Walk.trains(module)` says which weights train.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from enum import Enum

from .tape import Tape


class TPShare(Enum):
    """How each tensor-parallel rank holds a saved tensor of a block (Megatron-LM's layer, as
    labkit.distributed.tensor_parallel splits labkit's GPT): the key layout_terms.tp_layer_bytes reads."""

    STREAM = "whole on every rank, or 1/t of the sequence with sequence parallelism"  # norms, residual, dropout
    HEADS = "1/t: per head or per MLP feature"  # between a column-parallel matmul and its row-parallel partner
    LAYER = "whole on every rank"  # the (S, S) causal mask: one per layer, whatever t or the sequence split


@dataclass(eq=False)
class T:
    """A tensor of the walk: `numel` elements of `itemsize` bytes; a view points at its base."""

    numel: int
    itemsize: int
    name: str = ""
    base: "T | None" = None
    rg: bool = True  # requires grad: autograd records (and saves for) the ops that read it
    heads_moved: bool = False  # a (B, heads, S, d) tensor laid out as (B, S, heads, d): a projection's output
    # viewed per head, and what pointwise ops make from it (they keep the layout)
    weight: bool = False  # an autocast 16-bit copy of a weight (model-state bytes, counted apart from activations)
    expanded: bool = False  # a view with a stride-0 dimension (expand): a copy of it is whole (numel elements)
    tp: TPShare | None = None  # how a tensor-parallel rank holds it (None: STREAM; Walk.per_head sets HEADS)
    scores: bool = False  # attention probabilities (S x S per head) or what is made from them (dropout, copies):
    # the summary table's s^2 term (predict._terms)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def root(self) -> "T":
        return self.base.root() if self.base is not None else self


@dataclass
class Walk:
    """Walk a forward pass on shapes. autocast: matmuls run in 16-bit on 16-bit copies of inputs.

    x_bytes: bytes per element of the residual stream (the parameters' dtype; a frozen base's under PEFT).
    train_bytes: bytes per element of the trained parameters (None: x_bytes), e.g. fp32 adapters over a bf16 base.
    low_bytes: bytes per element of autocast's low precision (2), unused without autocast.
    device: "cpu" or "cuda" (dropout masks and fused attention differ).
    """

    x_bytes: int
    autocast: bool = False
    low_bytes: int = 2
    train_bytes: int | None = None
    device: str = "cpu"
    saved: dict[int, T] = field(default_factory=dict)  # id(root) -> root tensor
    frozen: bool = False  # every base weight frozen (LoRA, QLoRA)
    lora: dict[str, int] = field(default_factory=dict)  # adapted Linear module name -> LoRA rank
    active: frozenset | None = None  # LISA: indices of the layers that train (None: all)
    # Linears stored quantized (dequantized on the fly, save nothing): the adapted ones, and under
    # quant_set "all-linear" the others but the head (frozen, no adapter)
    quant_modules: frozenset = frozenset()
    quant: str = "none"  # which: "int8", "nf4", "int4" or "int4-awq"
    linears: dict[str, tuple] = field(default_factory=dict)  # module name -> (d_in, d_out, bias elements)
    copy_bytes: int = 0  # autocast's 16-bit weight copies alive through the forward (see `_count_copies`)
    copy_unsaved: int = 0  # the part of copy_bytes no op saves: freed as the forward's autocast exits
    copy_frozen: dict = field(default_factory=dict)  # module -> bytes of a frozen weight's copy (saved, not cached)
    forward_extra: int = 0  # alive through the whole forward, never saved (transformers' 4-D float mask)
    forward_locals: int = 0  # tensors a model's forward function holds in locals until it returns (embeddings)
    locals_saved: int = 0  # such locals that are also saved for backward (position ids, rotary tables)
    block0_local: int = 0  # the part of forward_locals that is block 0's input (Llama's inputs_embeds)
    block_kwargs: tuple = (0, 0)  # tensors passed to every block besides its input (position ids, rotary cos and
    # sin, the 4-D mask): (their bytes, the part also saved before the first block); a checkpoint holds them
    final_out: tuple = (0, 0)  # transformers: the final norm's output, held by the model's output object while
    # the head and the loss run: (its bytes, the part no op saves)
    loss_locals: tuple = (0, 0)  # labkit GPT computes its loss inside its forward: what that forward's locals
    # hold while the loss runs (position ids, the last block's output, the chunked loss's input): (bytes, the part
    # no op saves)
    saved_total: int = 0  # bytes of `saved`, summed as tensors are saved (read once per layer by `mark`)
    tape: Tape = field(default_factory=Tape)  # allocations, lifetimes and backward nodes, for the replays
    block_end: list = field(default_factory=list)  # tensors a block's locals hold until it returns
    log_softmax: T | None = None  # the loss's saved log-softmax (cross_entropy), None before the loss
    loss_scratch: tuple | None = None  # a chunked loss (labkit.recompute.chunked_ce): its (forward, backward) scratch
    loss_chunks: int | None = None  # Recipe.loss_chunks: the head and loss in chunks along S
    output_chunks: tuple | None = None  # with loss_chunks: rows of each chunk (chunked_output)
    # with loss_chunks: (bytes the chunks' head matmuls save as their inputs, whether each chunk's is its
    # own copy, freed with its matmul's backward; else views of one tensor, freed after the last chunk)
    output_chunk_inputs: tuple = (0, False)
    heads_region: bool = False  # inside `per_head`: what is made is per head or per MLP feature (TPShare.HEADS)

    # ---- bookkeeping -------------------------------------------------------------------------
    def freeze(self) -> None:
        """No more changes: the estimator caches a finished walk and every estimate of that shape reads it
        (predict.walk_activations); setting a field afterwards raises."""
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"a finished walk is read-only (Walk.{name}): the estimator caches and shares it")
        object.__setattr__(self, name, value)

    def new(self, numel: int, itemsize: int, name: str = "", rg: bool = True) -> T:
        return self._share(T(int(numel), int(itemsize), name, rg=rg))

    def _share(self, t: T) -> T:
        if self.heads_region and t.tp is None:
            t.tp = TPShare.HEADS
        return t

    @contextlib.contextmanager
    def per_head(self, *inputs: T):
        """The ops between a column-parallel matmul and its row-parallel partner (attention, the MLP's
        activation): `inputs` (the column-parallel outputs) and every tensor made inside are per head or per
        feature (TPShare.HEADS), but those made with a share of their own (the causal mask)."""
        for t in inputs:
            t.root().tp = TPShare.HEADS
        self.heads_region = True
        try:
            yield
        finally:
            self.heads_region = False

    def trains(self, module: str) -> bool:
        """Whether the module's own weights get gradients: not when frozen; with LISA, modules outside
        the layer list always, those in layer i when i is active."""
        if self.frozen:
            return False
        m = re.search(r"\.(\d+)\.", "." + module + ".")
        return self.active is None or m is None or int(m.group(1)) in self.active

    def save(self, *ts: T) -> None:
        """Keep tensors for backward (once each, by storage)."""
        for t in ts:
            r = t.root()
            if id(r) not in self.saved:
                self.saved[id(r)] = r
                self.saved_total += r.nbytes

    @property
    def saved_bytes(self) -> int:
        return self.saved_total

    @property
    def tb(self) -> int:
        """Bytes per element of a trained parameter (and of its gradient)."""
        return self.x_bytes if self.train_bytes is None else self.train_bytes

    @property
    def frozen_copy(self) -> bool:
        """Whether autocast copies a frozen weight for its matmul: not when it is stored in 16 bits already."""
        return self.autocast and self.x_bytes != self.low_bytes

    @property
    def mm_bytes(self) -> int:
        """Bytes per element of a matmul's output: 16-bit under autocast, else the stream dtype."""
        return self.low_bytes if self.autocast else self.x_bytes

    def as_matmul_input(self, x: T) -> T:
        """Under autocast an fp32 input is copied to 16-bit first, and the copy is what is saved."""
        if self.autocast and x.itemsize != self.low_bytes:
            return self.new(x.numel, self.low_bytes, f"{x.name} (16-bit copy)")
        return x

    # ---- the tape: allocations, Python lifetimes and backward nodes (labkit.estimate.tape) ---------
    def made(self, t: T, cached: bool = False) -> T:
        """t is a fresh storage made by an op (recorded for the replays)."""
        return self.tape.new(self._share(t), cached)

    def drop(self, *ts: T) -> None:
        """The code lets these tensors go (freed unless saved, or held by another reference)."""
        self.tape.drop(*ts)

    def node(self, op: str, outs, saved=(), steps=(), reads_weight: bool = False) -> None:
        """An autograd node (recorded when anything it reads requires grad): the one record of what autograd
        saves. Its saved tensors are the walk's activations (`save`), but autocast's weight copies (model
        state: `copy_bytes`)."""
        self.tape.node(op, outs, saved, steps, reads_weight)
        self.save(*(t for t in saved if t is not None and not t.root().weight))

    def cast(self, x: T, itemsize: int, name: str = "") -> T:
        """x.to(dtype): a copy when the dtype changes; its backward casts the gradient back (x's bytes)."""
        if x.itemsize == itemsize:
            return x
        y = self.made(self.new(x.numel, itemsize, name or f"{x.name} ({8 * itemsize}-bit copy)", x.rg))
        y.heads_moved, y.scores = x.heads_moved, x.scores  # .to() keeps the strides
        if x.rg:
            self.node("to_copy", [y], (), [("grad", x)])
        return y

    def _weight_copy(self, elements: int, trains: bool, name: str) -> tuple[T | None, list[tuple]]:
        """Under autocast, a weight's 16-bit copy (cached until the forward ends when the weight trains, else a
        temporary) and the steps its matmul's backward takes for the weight: without autocast the gradient
        goes straight to .grad; under autocast the matmul makes a 16-bit one, and the copy's own node (it runs
        once the matmul's has returned) casts it to the parameter's dtype."""
        if not self.autocast:
            return None, ([("wgrad", elements * self.tb)] if trains else [])
        if not trains and not self.frozen_copy:  # a 16-bit frozen weight: the matmul reads it as it is
            return None, []
        w16 = self.new(elements, self.low_bytes, name, trains)
        w16.weight = True
        self.made(w16, cached=trains)
        if not trains:
            return w16, []
        self.node(f"{name}: cast back", [w16], (), [("wgrad", elements * self.tb)])
        return w16, [("grad", w16)]

    def _matmul(self, x: T, module: str, trains: bool, rows: int, d_out: int, name: str, saved_x: T | None,
                out_itemsize: int | None = None) -> T:
        """One nn.Linear / Conv1D call on the tape: autocast's weight and input copies (a trained weight's is
        cached until the forward ends), the output, and the node: dW (and db) when it trains, dx when x
        requires grad. `saved_x`: the tensor the walk saved for dW (x or its 16-bit copy). Autocast's casts
        are made weight first (their nodes run after the matmul's: the input's, then the weight's)."""
        d_in, _, bias = self.linears.get(module, (x.numel // max(rows, 1), d_out, 0))
        w16, wsteps = self._weight_copy(d_in * d_out, trains, f"{module} weight (16-bit copy)")
        xc = x
        if self.autocast and x.itemsize != self.low_bytes:
            xc = saved_x if saved_x is not None and saved_x is not x else self.new(x.numel, self.low_bytes,
                                                                                     f"{x.name} (16-bit copy)")
            self.made(xc)
            if x.rg:
                self.node("autocast input cast", [xc], (), [("grad", x)])
        _, bsteps = self._weight_copy(bias, trains, f"{module} bias (16-bit copy)") if bias and trains else (None, [])
        if bsteps and not self.autocast:  # the engine sums the bias's gradient once the node has returned
            bsteps = [("bgrad", bias * self.x_bytes)]
        y = self.made(self.new(rows * d_out, out_itemsize or self.mm_bytes, name, x.rg or trains))
        self.keep(y, "linear")
        if x.rg or trains:
            steps = [*wsteps, *bsteps] + ([("grad", xc)] if x.rg else [])
            saved = ([xc] if trains else []) + ([w16] if w16 is not None and x.rg else [])
            # autograd saves the weight itself for dx when no 16-bit copy stands in for it
            self.node(f"{module or name} matmul", [y], saved, steps, reads_weight=x.rg and w16 is None)
        if xc is not x:
            self.drop(xc)
        if w16 is not None and not trains:
            self.drop(w16)
        return y

    def _dequant_matmul(self, x: T, module: str, rows: int, d_out: int, name: str) -> T:
        """labkit.quant.dequant_linear on the tape: x.to(compute dtype), the weight dequantized (scratch of
        NF4/INT8_DEQUANT_BYTES_PER_WEIGHT per weight, the result included) and freed after the matmul; the
        node saves nothing and dequantizes again for dx; the output is cast back to x's dtype."""
        from labkit.estimate.peft_terms import dequant_bytes_per_weight

        d_in = self.linears[module][0]
        cb = self.low_bytes if self.autocast else self.x_bytes  # the compute dtype (labkit.run.apply_peft)
        per = dequant_bytes_per_weight(self.quant, cb)
        n = d_in * d_out
        xq = self.cast(x, cb, f"{x.name} (compute-dtype copy)")
        scratch = self.made(self.new((per - cb) * n, 1, f"{module} dequantization scratch"))
        w = self.made(self.new(n, cb, f"{module} dequantized weight"))
        self.drop(scratch)
        out = self.made(self.new(rows * d_out, cb, name, x.rg))
        self.keep(out, "linear")
        self.drop(w)
        if x.rg:
            self.node(f"{module} dequant matmul", [out], (), [
                ("tmp", "dequantization scratch", (per - cb) * n), ("tmp", "dequantized weight", cb * n),
                ("free", "dequantization scratch"), ("grad", xq), ("free", "dequantized weight")])
        if xq is not x:
            self.drop(xq)
        y = self.cast(out, x.itemsize, f"{name} (back to the input's dtype)")
        if y is not out:
            self.drop(out)
        return y

    def _lora_path(self, x: T, module: str, rows: int, d_out: int, name: str, saved_in: T, a_out: T, base: T) -> T:
        """LoRALinear's side path on the tape: h = x.to(adapter dtype), A then B (autocast copies h to
        16-bit: the saved `saved_in`), times the scaling, added to the base's output."""
        d_in, r = self.linears[module][0], self.lora[module]
        h = self.cast(x, self.tb, f"{name} adapter input (adapter dtype)")
        a16, asteps = self._weight_copy(r * d_in, True, f"{module}.lora_A (16-bit copy)")
        a_in = h
        if self.autocast:
            a_in = self.made(saved_in)
            if h.rg:
                self.node("autocast input cast", [a_in], (), [("grad", h)])
        self.made(a_out)
        self.keep(a_out, "linear")
        self.node(f"{module}.lora_A matmul", [a_out], [a_in] + ([a16] if h.rg and a16 else []),
                  asteps + ([("grad", a_in)] if h.rg else []))
        if a_in is not h:
            self.drop(a_in)
        b16, bsteps = self._weight_copy(d_out * r, True, f"{module}.lora_B (16-bit copy)")
        b = self.made(self.new(rows * d_out, self.mm_bytes, f"{name} lora_B out"))
        self.keep(b, "linear")
        self.node(f"{module}.lora_B matmul", [b], [a_out] + ([b16] if b16 else []), bsteps + [("grad", a_out)])
        self.drop(a_out)
        delta = self.made(self.new(b.numel, b.itemsize, f"{name} lora delta"))
        self.node("lora scaling", [delta], (), [("grad", b)])
        self.drop(b)
        y = self.made(self.new(base.numel, max(base.itemsize, delta.itemsize), name))
        steps = [("pass", t) if t.itemsize == y.itemsize else ("grad", t) for t in (base, delta) if t.rg or t is delta]
        self.node("lora sum", [y], (), steps)
        self.drop(delta, base)
        if h is not x:
            self.drop(h)
        return y

    # ---- primitives --------------------------------------------------------------------------
    def linear(self, x: T, rows: int, out_features: int, name: str, module: str = "") -> T:
        """y = x W^T + b saves x (to form dW = dy^T x); W is a parameter, already counted.

        A frozen W saves nothing (dx = dy W needs W only). A LoRA adapter (rank r) on the module
        saves A's input (x, or a fresh 16-bit copy under autocast) and the (rows, r) output of A."""
        trains, r = self.trains(module), self.lora.get(module, 0)
        q = module in self.quant_modules  # stored quantized: dequantized on the fly
        saved_x = self.as_matmul_input(x) if trains else None
        d_in, d_out, bias = self.linears.get(module, (0, 0, 0))
        adapter_in = a_out = None
        if r:
            adapter_in = self.new(x.numel, self.low_bytes, f"{name} adapter input") if self.autocast else x
            a_out = self.new(rows * r, self.mm_bytes, f"{name} lora_A out", True)
        if self.autocast and module in self.linears:
            self._count_copies(module, trains, x.rg, r, q)
        # a quantized base returns x's dtype (fp32 after an autocast LayerNorm), and base + adapter keeps it
        itemsize = x.itemsize if q else self.mm_bytes
        # the tape
        if q:
            base = self._dequant_matmul(x, module, rows, out_features, f"{name} base")
        else:
            base = self._matmul(x, module, trains, rows, out_features, name if not r else f"{name} base", saved_x)
        y = self._lora_path(x, module, rows, out_features, name, adapter_in, a_out, base) if r else base
        y.rg = x.rg or trains or r > 0
        assert y.itemsize == itemsize, (name, y.itemsize, itemsize)
        return y

    def _count_copies(self, module: str, trains: bool, x_rg: bool, r: int, q: bool) -> None:
        """Autocast's 16-bit copies that outlive the op: a trained weight and bias are cached until the
        forward's autocast exits, and after it live on only where the matmul saves them (a weight's, for
        dx, when x requires grad; a bias's never: copy_unsaved); a frozen weight's copy is not cached, and
        saved only when x requires grad, its bias copy not at all; a quantized base has none (it
        dequantizes); adapters are trained (A reads x, B reads A's output, which requires grad)."""
        d_in, d_out, bias = self.linears[module]
        low = self.low_bytes
        if trains:
            self.copy_bytes += low * (d_in * d_out + bias)
            self.copy_unsaved += low * (bias + (0 if x_rg else d_in * d_out))
        elif x_rg and not q and self.frozen_copy:
            self.copy_bytes += low * d_in * d_out
            self.copy_frozen[module] = low * d_in * d_out
        self.copy_bytes += low * r * (d_in + d_out)
        self.copy_unsaved += 0 if x_rg else low * r * d_in

    def keep(self, t: T, kind: str) -> None:
        """An op's output that selective checkpointing may keep instead of recomputing, when its policy keeps
        `kind` (labkit.estimate.tape.KEEP_KINDS). Call it right after the op makes t."""
        self.tape.keep(t, kind)

    def mark(self) -> int:
        """Bytes saved so far: the walk's position, for per-layer differences."""
        return self.saved_bytes

    def layer_norm(self, x: T, rows: int, name: str, module: str = "") -> T:
        """LayerNorm saves its input and two statistics per row (mean, 1/std): fp32 on CUDA, the
        input's dtype on CPU (one backward formula for input and weight: saved if either needs it).
        Tape: the output and the statistics (the module returns the output only); native_layer_norm_backward
        makes dx and, when they train, the weight's and bias's gradients."""
        trains = self.trains(module)
        rg = x.rg or trains
        x_in = x
        if self.autocast and self.device == "cuda" and x.itemsize != 4:  # CUDA autocast runs it in fp32
            x = self.cast(x, 4, f"{name} input (fp32 copy)")
        stats = self.new(2 * rows, 4 if self.device == "cuda" else x.itemsize, f"{name} stats")
        # CPU autocast leaves layer_norm in its input's dtype (fp32 after an fp32 stream, 16-bit after a 16-bit one)
        out = self.made(self.new(x.numel, 4 if self.autocast and x.itemsize == 4 else x.itemsize, f"{name} out", rg))
        self.made(stats)
        self.keep(out, "norm"), self.keep(stats, "norm")  # native_layer_norm's (out, mean, rstd)
        if rg:
            h = x.numel // max(rows, 1)
            self.node(f"{name} layer_norm", [out], [x, stats],
                      ([("grad", x)] if x.rg else []) + ([("wgrad", h * self.tb)] * 2 if trains else []))
        self.drop(stats)
        if x is not x_in:
            self.drop(x)
        return out

    def rms_norm_python(self, x: T, rows: int, name: str, module: str = "") -> T:
        """transformers' LlamaRMSNorm: h = x.float(); h = h * rsqrt(mean(h^2)+eps); weight * h.to(dtype).

        Saves the fp32 input (a copy if x is 16-bit), rsqrt's output (one fp32 per row) and the
        normalised tensor in x's dtype (the weight's gradient needs it: not saved for a frozen weight).
        Tape: pow, mean, add, rsqrt, mul, the cast back and the weight's mul, each with its backward.
        """
        trains = self.trains(module)
        x32 = x if x.itemsize == 4 else self.new(x.numel, 4, f"{name} fp32 copy", x.rg)
        rs = self.new(rows, 4, f"{name} rsqrt", x.rg)
        normed = self.new(x.numel, x.itemsize, f"{name} normed", x.rg)
        out = self.new(x.numel, x.itemsize, f"{name} out", x.rg or trains)
        # the tape
        if x32 is not x:
            self.made(x32)
            if x.rg:
                self.node("to fp32", [x32], (), [("grad", x)])
        sq = self.made(self.new(x.numel, 4, f"{name} pow", x.rg))
        var = self.made(self.new(rows, 4, f"{name} mean", x.rg))
        self.drop(sq)
        ve = self.made(self.new(rows, 4, f"{name} + eps", x.rg))
        self.made(rs)
        self.drop(ve)
        hn = normed if x.itemsize == 4 else self.new(x.numel, 4, f"{name} normalised (fp32)", x.rg)
        self.made(hn)
        self.drop(rs)
        if x32 is not x:
            self.drop(x32)  # `hidden_states` is rebound to the product
        if x.rg:
            self.node(f"{name} pow", [sq], [x32], [("tmp", "x^1", x32.nbytes), ("tmp", "2x", x32.nbytes),
                                                   ("grad", x32), ("free", "x^1"), ("free", "2x")])
            self.node(f"{name} mean", [var], (), [("grad", sq)])  # the gradient expanded and divided: a new tensor
            self.node(f"{name} + eps", [ve], (), [("pass", var)])
            self.node(f"{name} rsqrt", [rs], [rs], [("tmp", "rsqrt^3", 2 * rs.nbytes), ("grad", ve),
                                                    ("free", "rsqrt^3")])
            self.node(f"{name} x * rsqrt", [hn], [x32, rs], [("tmp", "grad * x", x32.nbytes), ("grad", x32),
                                                             ("grad", rs), ("free", "grad * x")])
        if hn is not normed:
            self.made(normed)
            if x.rg:
                self.node("to input dtype", [normed], (), [("grad", hn)])
            self.drop(hn)
        self.made(out)
        if x.rg or trains:
            self.node(f"{name} weight *", [out], [normed] if trains else [],
                      ([("grad", normed)] if x.rg else [])
                      + ([("tmp", "grad * normed", normed.nbytes), ("wgrad", (x.numel // max(rows, 1)) * self.tb),
                          ("free", "grad * normed")] if trains else []))
        self.drop(normed, var)
        return out

    def gelu(self, x: T, name: str) -> T:
        """Exact (erf) GELU in one kernel: saves its input only."""
        y = self.made(self.new(x.numel, x.itemsize, name, x.rg))
        self.keep(y, "activation")  # aten.gelu
        if x.rg:
            self.node(name, [y], [x], [("grad", x)])
        return y

    def gelu_tanh_python(self, x: T, name: str) -> T:
        """0.5*x*(1+tanh(c*(x+0.044715*x^3))) as separate ops (transformers' NewGELU).

        pow saves x; tanh saves its output; the final product saves both factors 0.5*x and 1+tanh:
        three new tensors of x's size besides x itself (the fused kernel would keep only x).
        Tape: Python evaluates 0.5*x first and holds it while the tanh term is built.
        """
        parts = {p: self.new(x.numel, x.itemsize, f"{name} {p}", x.rg) for p in ("0.5x", "tanh", "1+tanh")}
        new = lambda what: self.made(self.new(x.numel, x.itemsize, f"{name} {what}", x.rg))  # noqa: E731
        half = self.made(parts["0.5x"])
        cube = new("x^3")
        small = new("0.044715 x^3")
        self.drop(cube)
        inner = new("x + 0.044715 x^3")
        self.drop(small)
        scaled = new("c (x + 0.044715 x^3)")
        self.drop(inner)
        th = self.made(parts["tanh"])
        self.drop(scaled)
        one = self.made(parts["1+tanh"])
        self.drop(th)
        y = new("out")
        self.drop(half, one)
        if x.rg:
            self.node("0.5 x", [half], (), [("grad", x)])
            self.node("x^3", [cube], [x], [("tmp", "x^2", x.nbytes), ("tmp", "3 x^2", x.nbytes), ("grad", x),
                                           ("free", "3 x^2"), ("free", "x^2")])
            self.node("0.044715 x^3", [small], (), [("grad", cube)])
            self.node("x + ...", [inner], (), [("pass", x), ("pass", small)])
            self.node("c (...)", [scaled], (), [("grad", inner)])
            self.node("tanh", [th], [th], [("grad", scaled)])
            self.node("1 + tanh", [one], (), [("pass", th)])
            self.node("0.5x (1 + tanh)", [y], [half, one], [("grad", one), ("grad", half)])
        return y

    def silu(self, gate: T, name: str) -> T:
        """silu(gate) saves gate (the first half of Llama's SwiGLU)."""
        s = self.made(self.new(gate.numel, gate.itemsize, f"{name} silu", gate.rg))
        self.keep(s, "activation")  # aten.silu
        if gate.rg:
            self.node(f"{name} silu", [s], [gate], [("grad", gate)])
        return s

    def glu_mul(self, s: T, up: T, name: str) -> T:
        """silu(gate) * up saves up (for silu's gradient) and silu's output (for up's)."""
        y = self.made(self.new(s.numel, max(s.itemsize, up.itemsize), name, s.rg or up.rg))
        if s.rg or up.rg:
            self.node(f"{name} silu * up", [y], [t for t, other in ((up, s), (s, up)) if other.rg],
                      [("grad", t) for t in (up, s) if t.rg])
        return y

    def dropout(self, x: T, p: float, name: str) -> T:
        """Training dropout saves its mask: 1 byte (bool) on CUDA; on CPU a mask in x's dtype.
        Tape: the mask is made beside the output and goes when the module returns (unless saved)."""
        if p <= 0:
            return x
        mask = self.made(self.new(x.numel, 1 if self.device == "cuda" else x.itemsize, f"{name} mask"))
        y = self.made(self.new(x.numel, x.itemsize, name, x.rg))
        if x.rg:
            self.node(name, [y], [mask], [("grad", x)])
        self.drop(mask)
        return y

    def add(self, a: T, b: T, name: str) -> T:
        """Residual add: saves nothing; the result takes the wider dtype. Backward hands the gradient to
        each input as it is, or a copy for an input of another dtype or a broadcast (smaller) shape."""
        y = self.made(self.new(max(a.numel, b.numel), max(a.itemsize, b.itemsize), name, a.rg or b.rg))
        if y.rg:
            self.node(name, [y], (), [("pass", t) if (t.itemsize, t.numel) == (y.itemsize, y.numel) else ("grad", t)
                                      for t in (a, b) if t.rg])
        return y

    def hold_final(self, out: T) -> None:
        """transformers returns the final norm's output as `last_hidden_state`: the output object holds it
        until the CausalLM's forward returns (through the head and the loss)."""
        self.final_out = (out.nbytes, 0 if id(out.root()) in self.saved else out.nbytes)

    def cross_entropy(self, logits: T, rows: int, vocab: int, upcast: bool) -> T:
        """log_softmax saves its output (rows x vocab) and nll_loss the target; fp32 if upcast.

        Autocast runs the loss in fp32, as does `logits.float()` (transformers): then the fp32 copy
        of the logits exists while log_softmax runs, and its output is fp32.
        """
        itemsize = 4 if (upcast or self.autocast) else logits.itemsize
        lsm = self.new(rows * vocab, itemsize, "log_softmax(logits)")
        self.save(lsm)  # the loss always needs a gradient: something before it trains
        self.log_softmax = lsm
        return lsm
