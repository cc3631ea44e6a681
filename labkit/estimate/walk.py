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

import re
from dataclasses import dataclass, field


@dataclass(eq=False)
class T:
    """A tensor of the walk: `numel` elements of `itemsize` bytes; a view points at its base."""

    numel: int
    itemsize: int
    name: str = ""
    base: "T | None" = None
    rg: bool = True  # requires grad: autograd records (and saves for) the ops that read it

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def root(self) -> "T":
        return self.base.root() if self.base is not None else self


@dataclass
class Walk:
    """Walk a forward pass on shapes. autocast: matmuls run in 16-bit on 16-bit copies of inputs.

    x_bytes: bytes per element of the residual stream (the parameters' dtype).
    low_bytes: bytes per element of autocast's low precision (2), unused without autocast.
    device: "cpu" or "cuda" (dropout masks and fused attention differ).
    """

    x_bytes: int
    autocast: bool = False
    low_bytes: int = 2
    device: str = "cpu"
    saved: dict[int, T] = field(default_factory=dict)  # id(root) -> root tensor
    kept_bytes: int = 0  # outputs of matmul-like ops: what "matmuls" selective checkpointing keeps
    log: list[tuple[str, int]] = field(default_factory=list)  # (what, bytes) as saved
    frozen: bool = False  # every base weight frozen (LoRA, QLoRA)
    lora: dict[str, int] = field(default_factory=dict)  # adapted Linear module name -> LoRA rank
    active: frozenset | None = None  # LISA: indices of the layers that train (None: all)
    quantized: bool = False  # the adapted Linears' bases are int8/NF4 (dequantized on the fly, save nothing)
    linears: dict[str, tuple] = field(default_factory=dict)  # module name -> (d_in, d_out, bias elements)
    copy_bytes: int = 0  # autocast's 16-bit weight copies alive after the forward (see `linear`)
    trained: int = 0  # elements of the trained parameters the walk has passed (their gradients come in reverse)
    # worst moments inside ops (labkit.estimate.attention): (phase, what, saved bytes before the op,
    # the op's own saved bytes alive then, its temporaries then, `trained` before the op, kept bytes then)
    points: list[tuple] = field(default_factory=list)
    forward_extra: int = 0  # alive through the whole forward, never saved (transformers' 4-D float mask)
    forward_locals: int = 0  # tensors a model's forward function holds in locals until it returns (embeddings)
    saved_total: int = 0  # bytes of `saved`, summed as tensors are saved (read once per layer by `mark`)

    # ---- bookkeeping -------------------------------------------------------------------------
    def new(self, numel: int, itemsize: int, name: str = "", rg: bool = True) -> T:
        return T(int(numel), int(itemsize), name, rg=rg)

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
                self.log.append((r.name, r.nbytes))

    @property
    def saved_bytes(self) -> int:
        return self.saved_total

    @property
    def mm_bytes(self) -> int:
        """Bytes per element of a matmul's output: 16-bit under autocast, else the stream dtype."""
        return self.low_bytes if self.autocast else self.x_bytes

    def as_matmul_input(self, x: T) -> T:
        """Under autocast an fp32 input is copied to 16-bit first, and the copy is what is saved."""
        if self.autocast and x.itemsize != self.low_bytes:
            return self.new(x.numel, self.low_bytes, f"{x.name} (16-bit copy)")
        return x

    # ---- primitives --------------------------------------------------------------------------
    def linear(self, x: T, rows: int, out_features: int, name: str, module: str = "") -> T:
        """y = x W^T + b saves x (to form dW = dy^T x); W is a parameter, already counted.

        A frozen W saves nothing (dx = dy W needs W only). A LoRA adapter (rank r) on the module
        saves A's input (x, or a fresh 16-bit copy under autocast) and the (rows, r) output of A."""
        trains, r = self.trains(module), self.lora.get(module, 0)
        if trains:
            self.save(self.as_matmul_input(x))
        d_in, d_out, bias = self.linears.get(module, (0, 0, 0))
        self.trained += (d_in * d_out + bias if trains else 0) + r * (d_in + d_out)
        if r:
            self.save(self.new(x.numel, self.low_bytes, f"{name} adapter input") if self.autocast else x,
                      self.new(rows * r, self.mm_bytes, f"{name} lora_A out"))
        if self.autocast and module in self.linears:
            self._count_copies(module, trains, x.rg, r)
        # a quantized base returns x's dtype (fp32 after an autocast LayerNorm), and base + adapter keeps it
        itemsize = x.itemsize if r and self.quantized else self.mm_bytes
        return self.keep(self.new(rows * out_features, itemsize, name, rg=x.rg or trains or r > 0))

    def _count_copies(self, module: str, trains: bool, x_rg: bool, r: int) -> None:
        """Autocast's 16-bit copies that outlive the op: a trained weight and bias are cached until
        backward; a frozen weight's copy is saved by the matmul only when x requires grad (for dx),
        its bias copy not at all; a quantized base has none (it dequantizes); adapters are trained."""
        d_in, d_out, bias = self.linears[module]
        if trains:
            self.copy_bytes += self.low_bytes * (d_in * d_out + bias)
        elif x_rg and not (r and self.quantized):
            self.copy_bytes += self.low_bytes * d_in * d_out
        self.copy_bytes += self.low_bytes * r * (d_in + d_out)

    def keep(self, t: T) -> T:
        """Note a matmul-like op's output (selective checkpointing may keep it instead of recomputing)."""
        self.kept_bytes += t.nbytes
        return t

    def mark(self) -> tuple[int, int, int]:
        """(saved, kept bytes, trained elements) so far: the walk's position, for per-layer differences."""
        return self.saved_bytes, self.kept_bytes, self.trained

    def point(self, what: str, pts) -> None:
        """Record an op's worst forward and backward moments (an AttnPoints) at the walk's position."""
        for phase, (op, saved, temp) in (("forward", pts.forward), ("backward", pts.backward)):
            self.points.append((phase, f"{what}: {op}", self.saved_bytes, saved, temp, self.trained,
                                self.kept_bytes + pts.kept))

    def layer_norm(self, x: T, rows: int, name: str, module: str = "") -> T:
        """LayerNorm saves its input and two statistics per row (mean, 1/std): fp32 on CUDA, the
        input's dtype on CPU (one backward formula for input and weight: saved if either needs it)."""
        rg = x.rg or self.trains(module)
        if rg:
            self.save(x, self.new(2 * rows, 4 if self.device == "cuda" else x.itemsize, f"{name} stats"))
        return self.new(x.numel, 4 if self.autocast else x.itemsize, f"{name} out", rg)

    def rms_norm_python(self, x: T, rows: int, name: str, module: str = "") -> T:
        """transformers' LlamaRMSNorm: h = x.float(); h = h * rsqrt(mean(h^2)+eps); weight * h.to(dtype).

        Saves the fp32 input (a copy if x is 16-bit), rsqrt's output (one fp32 per row) and the
        normalised tensor in x's dtype (the weight's gradient needs it: not saved for a frozen weight).
        """
        trains = self.trains(module)
        if x.rg:
            x32 = x if x.itemsize == 4 else self.new(x.numel, 4, f"{name} fp32 copy")
            self.save(x32, self.new(rows, 4, f"{name} rsqrt"))
        if trains:
            self.save(self.new(x.numel, x.itemsize, f"{name} normed"))
        return self.new(x.numel, x.itemsize, f"{name} out", x.rg or trains)

    def gelu(self, x: T, name: str) -> T:
        """Exact (erf) GELU in one kernel: saves its input only."""
        if x.rg:
            self.save(x)
        return self.new(x.numel, x.itemsize, name, x.rg)

    def gelu_tanh_python(self, x: T, name: str) -> T:
        """0.5*x*(1+tanh(c*(x+0.044715*x^3))) as separate ops (transformers' NewGELU).

        pow saves x; tanh saves its output; the final product saves both factors 0.5*x and 1+tanh:
        three new tensors of x's size besides x itself (the fused kernel would keep only x).
        """
        if x.rg:
            self.save(x)
            for part in ("tanh", "0.5x", "1+tanh"):
                self.save(self.new(x.numel, x.itemsize, f"{name} {part}"))
        return self.new(x.numel, x.itemsize, name, x.rg)

    def silu_glu(self, gate: T, up: T, name: str) -> T:
        """silu(gate) * up: silu saves gate; the product saves silu's output (for up's gradient)
        and up (for silu's)."""
        s = self.new(gate.numel, gate.itemsize, f"{name} silu", gate.rg)
        if gate.rg:
            self.save(gate, up)
        if up.rg:
            self.save(s)
        return self.new(gate.numel, gate.itemsize, name, gate.rg or up.rg)

    def dropout(self, x: T, p: float, name: str) -> T:
        """Training dropout saves its mask: 1 byte (bool) on CUDA; on CPU a mask in x's dtype."""
        if p <= 0:
            return x
        if x.rg:
            self.save(self.new(x.numel, 1 if self.device == "cuda" else x.itemsize, f"{name} mask"))
        return self.new(x.numel, x.itemsize, name, x.rg)

    def add(self, a: T, b: T, name: str) -> T:
        """Residual add: saves nothing; the result takes the wider dtype."""
        return self.new(max(a.numel, b.numel), max(a.itemsize, b.itemsize), name, a.rg or b.rg)

    def cross_entropy(self, logits: T, rows: int, vocab: int, upcast: bool) -> T:
        """log_softmax saves its output (rows x vocab) and nll_loss the target; fp32 if upcast.

        Autocast runs the loss in fp32, as does `logits.float()` (transformers): then the fp32 copy
        of the logits exists while log_softmax runs, and its output is fp32.
        """
        itemsize = 4 if (upcast or self.autocast) else logits.itemsize
        lsm = self.new(rows * vocab, itemsize, "log_softmax(logits)")
        self.save(lsm)  # the loss always needs a gradient: something before it trains
        return lsm
