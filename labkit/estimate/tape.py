"""One block's ops as byte events, replayed the ways a checkpointed or offloaded step runs them.

The family walks (labkit.estimate.families) record on a `Tape` every tensor a block allocates, when its
Python reference goes, and for each autograd node what its backward reads (its saved tensors: the one
record of what autograd keeps, which the walk's activation bytes sum too) and allocates (gradients,
temporaries), in the order of the model's code. Each
replay walks those events with its own rule for what stays alive:

- forward, nothing saved (a checkpointed region, or activation offload: saved tensors leave the device):
  a tensor lives until its last Python reference goes;
- forward, selective checkpointing: the cached outputs stay too (which ops' outputs: the tape's `kinds`,
  from the runtime's policy, `keep_kinds`);
- forward with everything saved (the recompute of a checkpointed block);
- backward with offload: each node copies its saved tensors back to the device (one copy per storage),
  makes its gradients, and the copies go when it returns;
- backward of a recomputed block: every saved tensor is alive again, and goes after the last node
  that reads it.

Backward runs the nodes in reverse creation order, as autograd's ready queue does (highest sequence
number first). A node's gradient for an input goes to that input's buffer; a second contribution is
summed out of place (a new tensor; both parts freed), which is what the ledger shows for the residual
stream. A gradient passed through unchanged (a residual add, a view) shares its storage.

Sources: tools/autograd/derivatives.yaml (what each op saves and computes), torch/csrc/autograd/engine.cpp
and input_buffer.cpp (order and accumulation), labkit.recompute.checkpoint and .offload (what a
checkpointed region and the offload hooks keep).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

# What made a tensor the walks mark with `keep`: each kind is the set of aten ops (by name) that make it in
# labkit.recompute.selective. A policy keeps a kind when it keeps every op of it (`keep_kinds`).
KEEP_KINDS = {
    "linear": ("mm", "addmm"),  # nn.Linear / Conv1D projections (LoRA's A and B, a dequantized base's matmul)
    "attention": ("bmm", "_scaled_dot_product_flash_attention_for_cpu", "tiled_attention"),  # the attention core
    "norm": ("native_layer_norm",),  # LayerNorm: its output, mean and rstd (transformers' RMSNorm is pointwise ops)
    "activation": ("gelu", "silu"),  # the MLP's activation when it is one kernel (not NewGELU's pointwise ops)
}
_MATMULS = frozenset({"linear", "attention"})


def keep_kinds(policy: str = "matmuls") -> frozenset:
    """The kinds of kept outputs selective checkpointing with `policy` ("matmuls" or "attention-core") holds,
    derived from labkit.recompute.selective.POLICIES: a kind is kept when every op that makes it is."""
    from labkit.recompute.selective import POLICIES

    if policy not in POLICIES:
        raise ValueError(f"selective_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    names = {getattr(op, "__name__", str(op)).split(".")[0] for op in POLICIES[policy]}
    kinds = set()
    for kind, ops in KEEP_KINDS.items():
        hit = [op in names for op in ops]
        if all(hit):
            kinds.add(kind)
        elif any(hit):
            raise ValueError(f"selective policy {policy!r} keeps some of the {kind} ops {ops} but not all: "
                             "the estimator cannot model it")
    return frozenset(kinds)


@dataclass(eq=False)
class Node:
    """One autograd node: `outs` are the tensors whose gradients it reads, `saved` what it unpacks, and
    `steps` its backward, in order: ("grad", t) a gradient for input t (t's bytes), ("pass", t) the
    incoming gradient handed to t unchanged, ("tmp", name, nbytes) / ("free", name) a temporary,
    ("wgrad", nbytes) a parameter's gradient (accumulated into .grad), ("bgrad", nbytes) a bias's gradient that
    the engine sums out of the broadcast node's gradient once the node has returned (validate_outputs)."""

    op: str
    outs: tuple
    saved: tuple
    steps: tuple
    reads_weight: bool = False  # it unpacks a parameter autograd saved (a frozen matmul's weight, for dx): no
    # activation bytes, but a checkpoint's unpack hook recomputes its region there all the same


class Ev(Enum):
    """What a tape event records."""

    NEW = "a fresh storage"
    DROP = "a Python reference goes"
    NODE = "an autograd node"
    KEEP = "an output selective checkpointing caches"
    BLOCK = "a block starts"
    END = "the last block's output"
    HEAD = "the final norm's output"


class Event(NamedTuple):
    kind: Ev
    t: object = None  # the tensor: made, dropped or kept; a block's input; the last block's or final norm's output
    cached: bool = False  # NEW: an autocast weight copy, alive until the forward ends
    node: Node | None = None  # NODE
    block: int = -1  # BLOCK: its index


@dataclass
class Tape:
    """The walk's events, in the order of the model's code (Event)."""

    events: list[Event] = field(default_factory=list)
    kinds: frozenset = _MATMULS  # the kinds of outputs selective checkpointing keeps (keep_kinds)

    def new(self, t, cached: bool = False):
        """A fresh storage (cached: an autocast weight copy, alive until the forward ends)."""
        self.events.append(Event(Ev.NEW, t, cached))
        return t

    def drop(self, *ts) -> None:
        """The Python references to these tensors go (their storage is freed unless held)."""
        self.events += [Event(Ev.DROP, t) for t in ts if t is not None]

    def node(self, op: str, outs, saved=(), steps=(), reads_weight: bool = False) -> None:
        self.events.append(Event(Ev.NODE, node=Node(op, tuple(outs), tuple(s for s in saved if s is not None),
                                                    tuple(steps), reads_weight)))

    def keep(self, t, kind: str) -> None:
        """Selective checkpointing caches this output until backward when its policy keeps `kind` (KEEP_KINDS).
        Record it right after the op makes t (before any drop of t)."""
        if kind not in KEEP_KINDS:
            raise ValueError(f"unknown kept-output kind {kind!r}")
        if kind in self.kinds:
            self.events.append(Event(Ev.KEEP, t))

    def block(self, i: int, x) -> None:
        """Block i starts; x is its input (held by the caller until the block returns)."""
        self.events.append(Event(Ev.BLOCK, x, block=i))

    def _at(self, kind: Ev) -> list[int]:
        return [k for k, ev in enumerate(self.events) if ev.kind is kind]

    def blocks(self) -> list[tuple]:
        """(events of block i, its input) for each block, in order."""
        starts = self._at(Ev.BLOCK)
        ends = starts[1:] + (self._at(Ev.END) + [len(self.events)])[:1]
        return [(self.events[k + 1:e], self.events[k].t) for k, e in zip(starts, ends)]

    def end(self, out) -> None:
        """The last block's output (what the final norm reads)."""
        self.events.append(Event(Ev.END, out))

    def head(self, out) -> None:
        """The final norm's output (what the head reads): the ops between `end` and here are the tail."""
        self.events.append(Event(Ev.HEAD, out))

    def tail(self) -> tuple | None:
        """(events of the final norm, its input, its output), or None when the walk marked no head."""
        ends, heads = self._at(Ev.END), self._at(Ev.HEAD)
        if not ends or not heads:
            return None
        return self.events[ends[0] + 1:heads[0]], self.events[ends[0]].t, self.events[heads[0]].t


def _root(t):
    return t.root()


def _saved_roots(events) -> set[int]:
    """The storages the events' autograd nodes save (by id)."""
    return {id(_root(t)) for ev in events if ev.kind is Ev.NODE for t in ev.node.saved}


@dataclass
class Worst:
    """A replay's worst moment: the op, the bytes live then (activations, temporaries, gradients of
    activations), and the bytes of parameter gradients made so far in the block."""

    op: str = ""
    live: int = 0
    grads: int = 0
    names: tuple = ()  # what is alive then (for debugging and explanations)
    cached: int = 0  # forward: bytes of autocast weight copies the block has cached by then
    trigger: int = 0  # backward: gradients alive when the first node reading saved tensors runs (a
    # checkpointed block's recompute starts there; the nodes before it save nothing)
    step: object = None  # backward: the worst moment a parameter's gradient is ready (its node returned):
    # a Worst whose `grads` is that gradient (labkit.optim.StepInBackward steps it there)
    saved: int = 0  # the part of `live` that is saved tensors (forward "all" / backward "saved": the forward's
    # own, so activations in the ledger when nothing is recomputed), autocast weight copies included
    copies: int = 0  # the part of `saved` that is autocast weight copies (parameter memory in the ledger)
    params: int = 0  # the part of `live` that is autocast weight copies, saved or not (parameter memory)
    kept: int = 0  # the part of `live` that is selective checkpointing's cached outputs: made by the forward,
    # so activations in the ledger even while a recompute or a backward reads them
    new_grads: int = 0  # the part of `live` that is parameter gradients made but not yet put into .grad
    # (keep_wgrads=False): a later micro-batch's, summed into .grad; under step in backward the first and
    # only micro-batch's, which AccumulateGrad stores as .grad itself (gradient memory in the ledger)
    last: object = None  # backward: when the block's last parameter gradient is ready (its node returned), a
    # Worst whose `grads` are all the block's: ZeRO-2 reduce-scatters a unit then (labkit.distributed.Zero)
    input_alive: bool = False  # `last`: the block's input is still saved for a node that has not run

    @property
    def total(self) -> int:
        return self.live + self.grads


def forward(events, x, mode: str, pre: frozenset = frozenset()) -> tuple[Worst, int]:
    """Replay a block's forward. mode: "free" (nothing saved), "kept" (selective: the policy's outputs cached),
    "saved" (everything autograd saves stays: a recompute, whose autocast weight copies are made again),
    "all" (everything saved stays, as in a step with no activation policy; autocast's cached weight copies
    counted apart, in `Worst.cached`, as in "free").
    pre: roots alive from the start and not made again (selective's cached outputs, handed back to the
    recompute; they go when the code drops them, unless saved).
    Returns the worst moment (the block input counted) and the bytes still held at the end for backward
    (the input and output not counted)."""
    x0 = id(_root(x))
    live: dict[int, int] = {x0: _root(x).nbytes}
    names = {x0: _root(x).name}
    for ev in events:
        if ev.kind is Ev.NEW and id(_root(ev.t)) in pre:
            live[id(_root(ev.t))] = _root(ev.t).nbytes
            names[id(_root(ev.t))] = _root(ev.t).name
    held: set[int] = set()
    weights = {id(_root(ev.t)) for ev in events if ev.kind is Ev.NEW and getattr(_root(ev.t), "weight", False)}
    if mode in ("saved", "all"):  # a saved tensor stays from its making (its node may be recorded a little later)
        held = _saved_roots(events)
    cur = sum(live.values())
    worst = Worst("block input", cur, saved=live[x0] if x0 in held else 0,
                  kept=sum(b for k, b in live.items() if k in pre))
    cache = 0
    for ev in events:
        kind, t = ev.kind, ev.t
        if kind is Ev.NEW:
            if ev.cached and mode != "saved":
                cache += _root(t).nbytes
                continue  # autocast's weight cache: counted with the model states
            r = _root(t)
            if id(r) in live:
                continue
            live[id(r)] = r.nbytes
            names[id(r)] = r.name
            cur += r.nbytes
            if cur > worst.live:
                worst = Worst(t.name, cur, 0, tuple(f"{names[k]}={b}" for k, b in live.items()), cache,
                              saved=sum(b for k, b in live.items() if k in held),
                              copies=sum(b for k, b in live.items() if k in held and k in weights),
                              params=sum(b for k, b in live.items() if k in weights),
                              kept=sum(b for k, b in live.items() if k in pre))
        elif kind is Ev.DROP:
            r = _root(t)
            if id(r) in live and id(r) not in held:
                cur -= live.pop(id(r))
        elif kind is Ev.KEEP and mode == "kept":
            held.add(id(_root(t)))
    left = sum(b for k, b in live.items() if k in held and k != x0)
    return worst, left


@dataclass(eq=False)
class _Grad:
    nbytes: int
    name: str
    refs: int = 1


def backward(events, x, out, stream: int, mode: str, keep_wgrads: bool = True,
             exclude: frozenset = frozenset(), kept: frozenset = frozenset(),
             unpacked: bool = False, held: bool = False) -> tuple[Worst, int]:
    """Replay a block's backward from its output's gradient (`stream` bytes) to its input's.

    mode "offload": each node copies back the storages it saved and frees them when it returns. mode
    "saved": the tensors the block saved (made inside it, autocast weight copies included; the roots in
    `exclude` are counted elsewhere) are alive at the start and go after their last reader.
    keep_wgrads: parameter gradients stay (first micro-batch) or are summed into .grad and freed.
    kept: roots that selective checkpointing cached in the forward (`Worst.kept` counts them among the saved).
    unpacked: the saved tensors come from a checkpoint's unpack hook (a recomputed block): they are the node's
    locals, gone when it returns, before the engine sums a bias's gradient; autograd's own saved tensors go
    after that (engine.cpp: evaluate_function releases the variables after call_function's validate_outputs).
    held: the caller holds the output's gradient until backward returns (a pipeline stage's received gradient,
    `torch.autograd.backward(out, grad)`): it is never freed here.
    Returns the worst moment and the bytes of the input's gradient at the end."""
    nodes = [ev.node for ev in events if ev.kind is Ev.NODE]
    made = {id(_root(ev.t)) for ev in events if ev.kind is Ev.NEW}
    last_use: dict[int, int] = {}  # saved root -> index (in reverse order) of its last reader
    roots: dict[int, object] = {}
    for i, n in enumerate(reversed(nodes)):
        for t in n.saved:
            last_use[id(_root(t))] = i
            roots[id(_root(t))] = _root(t)
    live: dict[object, tuple[str, int]] = {}  # key -> (what, bytes): everything this replay counts
    if mode == "saved":
        for k, r in roots.items():
            if k in made and k not in exclude:
                live[k] = (f"saved {r.name}", r.nbytes)
    first = _Grad(stream, f"gradient of {out.name}", refs=2 if held else 1)
    grads: dict[int, _Grad] = {id(out): first}
    live[first] = (first.name, stream)
    state = {"wg": 0, "worst": None}

    def total() -> int:
        return sum(b for _, b in live.values()) + state["wg"]

    def snapshot(what: str, now: int, wg: int) -> Worst:
        """What is live now (`now` bytes besides `wg` of parameter gradients), by kind."""
        saved = [(k, b) for k, (_, b) in live.items() if isinstance(k, int)]  # the saved roots (mode "saved")
        copies = sum(b for k, b in saved if getattr(roots[k], "weight", False))
        fresh = sum(b for k, (_, b) in live.items() if isinstance(k, tuple) and k[0] == "wgrad")
        return Worst(what, now, wg, tuple(f"{n}={b}" for n, b in live.values()), saved=sum(b for _, b in saved),
                     copies=copies, params=copies, kept=sum(b for k, b in saved if k in kept), new_grads=fresh)

    def peak(what: str):
        t = total()
        if state["worst"] is None or t > state["worst"].total:
            state["worst"] = snapshot(what, t - state["wg"], state["wg"])

    def release(g: _Grad):
        g.refs -= 1
        if g.refs == 0:
            live.pop(g, None)

    def give(t, g: _Grad, what: str):
        """Put gradient g into t's buffer (a second one is summed into a new tensor)."""
        old = grads.get(id(t))
        if old is None:
            grads[id(t)] = g
            return
        s = _Grad(t.nbytes, f"gradient of {t.name} (summed)")
        live[s] = (s.name, s.nbytes)
        peak(what + ": gradient sum")
        release(old)
        release(g)
        grads[id(t)] = s

    def wgrad(n: Node, nb: int, tmps: list, ready: list):
        ready.append(nb)
        state["wg"] += nb
        peak(f"{n.op}: a parameter's gradient")
        if not keep_wgrads:  # summed into the existing .grad once the node has returned
            state["wg"] -= nb
            key = ("wgrad", n, len(tmps))
            live[key] = (f"{n.op}: a parameter's gradient (summed into .grad after)", nb)
            tmps.append(key)

    peak("block output gradient")
    state["trigger"] = None
    state["step"] = state["last"] = None
    for i, n in enumerate(reversed(nodes)):
        if not any(id(o) in grads for o in n.outs):
            continue  # no gradient reaches it: autograd never runs it
        if (n.saved or n.reads_weight) and state["trigger"] is None:  # a checkpointed block is recomputed here
            state["trigger"] = sum(b for k, (_, b) in live.items() if k not in roots)
        incoming = [grads.pop(id(o)) for o in n.outs if id(o) in grads]
        copies = []
        if mode == "offload":
            for t in n.saved:
                r = _root(t)
                key = ("copy", id(r))
                if key not in live:
                    live[key] = (f"{r.name} copied back", r.nbytes)
                    copies.append(key)
                    peak(f"{n.op}: {r.name} copied back")
        tmps = []
        reduced = []  # bias gradients the engine makes once the node has returned (unpacked saved tensors gone)
        ready = []  # parameter gradients this node makes (ready once it returns)
        made_here = []  # (input, gradient): added to the inputs' buffers once the node has returned
        for step in n.steps:
            kind = step[0]
            if kind == "grad":
                t = step[1]
                g = _Grad(step[2] if len(step) > 2 else t.nbytes, f"gradient of {t.name}")
                live[g] = (g.name, g.nbytes)
                peak(f"{n.op}: gradient of {t.name}")
                made_here.append((t, g))
            elif kind == "pass":
                incoming[0].refs += 1
                made_here.append((step[1], incoming[0]))
            elif kind == "tmp":
                key = ("tmp", n, step[1])
                live[key] = (f"{n.op}: {step[1]}", step[2])
                tmps.append(key)
                peak(f"{n.op}: {step[1]}")
            elif kind == "free":
                live.pop(("tmp", n, step[1]), None)
            elif kind == "bgrad" and unpacked:
                reduced.append(step[1])
            elif kind in ("wgrad", "bgrad"):
                wgrad(n, step[1], tmps, ready)
        for key in tmps + copies:
            live.pop(key, None)
        if reduced:  # the saved tensors (the node's locals) are gone; the engine sums the bias's gradient
            for k in [k for k, r in roots.items() if last_use.get(k) == i]:
                live.pop(k, None)
            tmps = []
            for nb in reduced:
                wgrad(n, nb, tmps, ready)
            for key in tmps:
                live.pop(key, None)
        for k in [k for k, r in roots.items() if last_use.get(k) == i]:  # the node's saved tensors are released
            live.pop(k, None)
        for g in incoming:
            release(g)
        for t, g in made_here:
            give(t, g, n.op)
        for nb in ready:  # the moment a step in backward would run (the gradient not counted in `wg`)
            t = total() - (state["wg"] if keep_wgrads else 0)
            if state["step"] is None or t + nb > state["step"].total:
                state["step"] = snapshot(f"{n.op}: its parameter steps", t, nb)
        if ready:  # the latest node to make a parameter gradient: after the last one, all the block's exist
            state["last"] = snapshot(f"{n.op}: the block's last parameter gradient is ready",
                                     total() - state["wg"], state["wg"])
            state["last"].input_alive = last_use.get(id(_root(x)), -1) > i
    g_in = grads.get(id(x))
    worst = state["worst"]
    worst.trigger = state["trigger"] if state["trigger"] is not None else stream
    worst.step, worst.last = state["step"], state["last"]
    return worst, (g_in.nbytes if g_in else 0)


@dataclass
class BlockReplay:
    """One block's replays (labkit.estimate.moments reads them for every step: plain, checkpointed, offloaded).

    free / kept: the forward's worst moment with nothing saved / with the matmul outputs cached (the block
    input counted); kept_bytes: what selective checkpointing holds after the block. recompute: the worst
    moment of its forward run again with everything saved (cached matmul outputs not made again), and
    saved_bytes what that leaves for backward; input_saved: the input's bytes when the block saves it.
    offload / recomputed: the backward's worst moment (the output's gradient counted; `grads` the block's
    parameter gradients made by then), first micro-batch and later ones (gradients summed into .grad).
    full: the forward's worst moment with everything saved kept (no activation policy; the input counted,
    cached weight copies apart); copies_saved: the autocast weight copies the block's matmuls save (alive
    until their node's backward)."""

    input_bytes: int
    stream: int
    free: Worst
    kept: Worst
    kept_bytes: int
    recompute: Worst
    saved_bytes: int
    recompute_sel: Worst  # selective: the cached matmul outputs are handed back, not made again
    saved_sel: int  # what that recompute leaves (the cached outputs autograd saves included)
    input_saved: int
    offload: Worst
    offload_later: Worst
    recomputed: Worst
    recomputed_later: Worst
    wgrad_bytes: int  # all of the block's parameter gradients
    cached_bytes: int  # all of the block's autocast weight copies (cached while the forward runs)
    full: Worst | None = None
    plain: Worst | None = None  # the backward with the forward's own saved tensors (nothing recomputed or
    plain_later: Worst | None = None  # offloaded): autograd releases them after a bias's gradient is summed
    copies_saved: int = 0
    copies_frozen: int = 0  # the part of copies_saved that is not cached (frozen weights' copies)
    kept_saved: int = 0  # selective's cached outputs that autograd saves (the forward's, also in its recompute)


def _signature(events) -> tuple:
    """Blocks with the same op sequence (sizes, what requires grad) replay the same."""
    out = []
    for ev in events:
        if ev.kind is Ev.NODE:
            n = ev.node
            out.append((ev.kind, tuple(o.nbytes for o in n.outs), tuple(s.nbytes for s in n.saved),
                        tuple((st[0], st[-1] if isinstance(st[-1], int) else getattr(st[-1], "nbytes", 0))
                              for st in n.steps), n.reads_weight))
        elif ev.kind is not Ev.BLOCK:
            out.append((ev.kind, ev.t.nbytes, ev.t.rg, ev.cached))
    return tuple(out)


def replay_blocks(tape: Tape) -> list[BlockReplay]:
    """Every replay of every block (blocks with the same ops replayed once). A finished walk's tape does not
    change (predict.walk_activations caches and shares the walk), so its replays are made once too: the
    planner estimates the same walk of an 80-layer model dozens of times."""
    cached = tape.__dict__.get("_replays")
    if cached is None:
        cached = tape._replays = _replay_all(tape)
    return list(cached)  # the caller's list (a pipeline stage swaps its last block's replay)


def _replay_all(tape: Tape) -> list[BlockReplay]:
    blocks = tape.blocks()
    ends = [ev.t for ev in tape.events if ev.kind is Ev.END]
    outs = [x for _, x in blocks[1:]] + ends[:1]
    cache: dict[tuple, BlockReplay] = {}
    result = []
    for (events, x), out in zip(blocks, outs):
        key = (_signature(events), x.nbytes, out.nbytes, x.rg)
        if key not in cache:
            cache[key] = _replay(events, x, out)
        result.append(cache[key])
    return result


def replay_held(tape: Tape, k: int) -> BlockReplay:
    """Block k's replays when the caller holds its output's gradient through the backward: the last block of a
    pipeline stage that is not the last, whose output's gradient is received and kept in a local until
    `torch.autograd.backward` returns (labkit.distributed.pipeline)."""
    blocks = tape.blocks()
    events, x = blocks[k]
    out = blocks[k + 1][1] if k + 1 < len(blocks) else next(ev.t for ev in tape.events if ev.kind is Ev.END)
    return _replay(events, x, out, held=True)


def _replay(events, x, out, held: bool = False) -> BlockReplay:
    kept_roots = frozenset(id(_root(ev.t)) for ev in events if ev.kind is Ev.KEEP)
    free, _ = forward(events, x, "free")
    kept, kept_bytes = forward(events, x, "kept")
    recompute, saved_bytes = forward(events, x, "saved")
    recompute_sel, saved_sel = forward(events, x, "saved", pre=kept_roots)
    saved_roots = _saved_roots(events)
    made = {id(_root(ev.t)): _root(ev.t) for ev in events if ev.kind is Ev.NEW}
    cached = {id(_root(ev.t)) for ev in events if ev.kind is Ev.NEW and ev.cached}
    stream = out.nbytes
    return BlockReplay(
        input_bytes=_root(x).nbytes, stream=stream, free=free, kept=kept, kept_bytes=kept_bytes,
        recompute=recompute, saved_bytes=saved_bytes, recompute_sel=recompute_sel, saved_sel=saved_sel,
        input_saved=_root(x).nbytes if id(_root(x)) in saved_roots else 0,
        offload=backward(events, x, out, stream, "offload", held=held)[0],
        offload_later=backward(events, x, out, stream, "offload", keep_wgrads=False, held=held)[0],
        recomputed=backward(events, x, out, stream, "saved", kept=kept_roots, unpacked=True, held=held)[0],
        recomputed_later=backward(events, x, out, stream, "saved", keep_wgrads=False, kept=kept_roots,
                                  unpacked=True, held=held)[0],
        plain=backward(events, x, out, stream, "saved", held=held)[0],
        plain_later=backward(events, x, out, stream, "saved", keep_wgrads=False, held=held)[0],
        wgrad_bytes=sum(st[1] for ev in events if ev.kind is Ev.NODE for st in ev.node.steps
                        if st[0] in ("wgrad", "bgrad")),
        cached_bytes=sum(_root(ev.t).nbytes for ev in events if ev.kind is Ev.NEW and ev.cached),
        full=forward(events, x, "all")[0],
        copies_saved=sum(t.nbytes for k, t in made.items() if k in saved_roots and getattr(t, "weight", False)),
        kept_saved=sum(t.nbytes for k, t in made.items() if k in saved_roots and k in kept_roots),
        copies_frozen=sum(t.nbytes for k, t in made.items() if k in saved_roots and getattr(t, "weight", False)
                          and k not in cached))


@dataclass
class TailReplay:
    """The final norm's backward (between the head's and the last block's): its worst moment with its saved
    tensors alive (first micro-batch, later ones) and copied back (offload), and its input's bytes when it
    saves it (the last block's output, made outside the tail)."""

    saved: Worst
    saved_later: Worst
    offload: Worst
    offload_later: Worst
    input_saved: int


def replay_tail(tape: Tape) -> TailReplay | None:
    if "_tail" not in tape.__dict__:
        tape._tail = _replay_tail(tape)
    return tape._tail


def _replay_tail(tape: Tape) -> TailReplay | None:
    t = tape.tail()
    if t is None:
        return None
    events, x, out = t
    saved_roots = _saved_roots(events)
    return TailReplay(
        saved=backward(events, x, out, out.nbytes, "saved")[0],
        saved_later=backward(events, x, out, out.nbytes, "saved", keep_wgrads=False)[0],
        offload=backward(events, x, out, out.nbytes, "offload")[0],
        offload_later=backward(events, x, out, out.nbytes, "offload", keep_wgrads=False)[0],
        input_saved=_root(x).nbytes if id(_root(x)) in saved_roots else 0)
