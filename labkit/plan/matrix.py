"""The technique selection matrix, from measurements: what each memory technique saves, costs and changes.

`run_matrix(size)` trains one labkit GPT on Shakespeare (byte tokens) under the fp32 AdamW baseline and under
each technique of TECHNIQUES (one change to the baseline's Recipe each) and measures, against the baseline:

- memory: the peak of two training steps under labkit's Ledger (`labkit.run.measure_step`), and each
  category's largest bytes over the step (which categories the technique cuts, which it adds);
- time: the median wall-clock time of the training steps after the first two (no Ledger);
- accuracy: the validation loss after the same number of steps from the same start on the same batches.

Tiled attention (labkit.recompute.tiled_attention) is not a row: the baseline's fused SDPA already runs the
same algorithm in a kernel and keeps the same bytes (q, k, v, the output and one logsumexp per row), so the row
would show nothing saved and the Python loops' time; lesson 03 measures it against the textbook attention.

It also classifies the regime: from the baseline's estimate (`labkit.estimate.estimate`), a (batch, seq) is
activation-bound when activations and temporaries outweigh the model states (parameters, gradients, optimizer
state) at the estimated peak, state-bound otherwise; a technique whose largest cut is activations wins in
the first regime, one whose largest cut is a model state in the second (`regime`).

bench/selection_matrix.py runs it and writes data/selection_matrix.json (committed: a real run with its machine
and date); `load_matrix()` reads that file, `matrix_table()` makes one row per technique and `plot_matrix()`
draws memory saved against time cost. Times are this machine's: compare ratios, never the seconds; the table and
the plot name the device they were measured on. A CPU's times are not a GPU's costs (offload moves nothing on a
CPU: its "host" is the same memory), so `predicted_gpu(matrix, preset)` adds what the planner's cost model
(labkit.plan.cost) predicts on a GPU preset for the same recipes, marked predicted, with what each cost is made
of (bytes over the host link / its bandwidth, recompute FLOPs, the optimizer's memory traffic).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from labkit.estimate import Recipe, estimate
from labkit.memory.report import CATEGORIES, Category
from labkit.paths import REPO_ROOT

MATRIX_FILE = REPO_ROOT / "data" / "selection_matrix.json"
LR = 1e-3  # every technique's learning rate, but Lion's and Adafactor's (relative steps, as transformers' default)
LION_LR = 3e-4  # Lion wants a 3-10x smaller step than AdamW (Chen et al. 2023, arXiv 2302.06675)
ACTIVATION_CATEGORIES = (Category.ACT, Category.TEMP)
STATE_CATEGORIES = (Category.PARAM, Category.BUFFER, Category.GRAD, Category.OPT)

# size -> the GPT's config, batch, seq and training steps. "default": the committed run (a few minutes on 2 CPU
# cores); "smoke": the tests' (seconds).
SIZES = {
    "default": {"model": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128), "batch": 8, "seq": 64,
                "steps": 24, "val_batches": 4},
    "smoke": {"model": dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32), "batch": 4, "seq": 16,
              "steps": 4, "val_batches": 2},
}

# (key, label, options(size) -> the Recipe fields it changes from the fp32 AdamW baseline; "model": GPTConfig fields)
TECHNIQUES = (
    ("bf16", "mixed precision bf16", lambda z: dict(dtype="mixed-bf16")),
    ("ckpt_full", "full checkpointing", lambda z: dict(checkpoint="full")),
    ("ckpt_sqrt", "sqrt checkpointing", lambda z: dict(checkpoint="sqrt")),
    ("ckpt_selective", "selective checkpointing", lambda z: dict(checkpoint="selective")),
    ("offload_act", "activation offload", lambda z: dict(offload_activations=True)),
    ("chunked_loss", "chunked cross-entropy", lambda z: dict(model=dict(loss_chunk=max(1, z["batch"] * z["seq"] // 4)))),
    ("accumulation", "gradient accumulation (micro-batch 1/2)", lambda z: dict(micro_batch=z["batch"] // 2)),
    ("adamw8bit", "8-bit Adam", lambda z: dict(optimizer="adamw8bit")),
    ("adafactor", "Adafactor", lambda z: dict(optimizer="adafactor")),
    ("lion", "Lion", lambda z: dict(optimizer="lion")),
    ("galore", "GaLore", lambda z: dict(optimizer="galore", rank=z["model"]["n_embd"] // 4)),
    ("galore8bit", "8-bit GaLore", lambda z: dict(optimizer="galore8bit", rank=z["model"]["n_embd"] // 4)),
    ("offload_cpu", "optimizer offload (cpu)", lambda z: dict(optimizer_offload="cpu")),
    ("step_in_backward", "step-in-backward", lambda z: dict(step_in_backward=True)),
    ("lora", "LoRA", lambda z: dict(lora_rank=8)),
    ("qlora", "QLoRA (nf4)", lambda z: dict(lora_rank=8, quant="nf4")),
    ("lisa", "LISA", lambda z: dict(lisa_layers=1)),
)
TECHNIQUE_KEYS = tuple(k for k, _, _ in TECHNIQUES)


def _size(size) -> dict:
    if isinstance(size, dict):
        return size
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    return SIZES[size]


def _config(z: dict):
    from labkit.models.gpt import GPTConfig

    return GPTConfig(**z["model"])


def technique_recipe(key: str, size="default") -> Recipe:
    """The Recipe of one technique (or "baseline": fp32 AdamW) at a bench size."""
    z = _size(size)
    if key == "baseline":
        options = {}
    else:
        found = [t for t in TECHNIQUES if t[0] == key]
        if not found:
            raise ValueError(f"unknown technique {key!r}; choose baseline or one of {', '.join(TECHNIQUE_KEYS)}")
        options = found[0][2](z)
    model = _config(dict(z, model={**z["model"], **options.pop("model", {})}))
    return Recipe(model, z["batch"], z["seq"], **options)


def regime(model, batch: int, seq: int, **options) -> dict:
    """From the estimate of a step (fp32 AdamW unless options say otherwise): the bytes of activations
    (activations + temporaries) and of model states (parameters, buffers, gradients, optimizer state) at the
    estimated peak, and "activation-bound" or "state-bound" by the larger."""
    e = estimate(model, batch, seq, **options)
    peak = e.peak
    act = sum(peak[c] for c in ACTIVATION_CATEGORIES)
    state = sum(peak[c] for c in STATE_CATEGORIES)
    return {"batch": batch, "seq": seq, "peak": peak.total, "activation_bytes": act, "state_bytes": state,
            "regime": "activation-bound" if act > state else "state-bound"}


def _category_max(meas) -> dict[str, int]:
    """Each category's largest bytes over the measured step (any phase), by category name."""
    return {c.name.lower(): max(int(b[c]) for b in meas.phases.values()) for c in CATEGORIES}


class _Trainer:
    """One technique's training run, built as labkit.run.measure_step builds the recipe (no Ledger), stepped one
    step at a time so that run_matrix can interleave the techniques' steps (a load on a shared machine then
    slows all of them alike)."""

    def __init__(self, recipe: Recipe, lr: float, train, seed: int):
        from labkit.run import LISA_INTERVAL, apply_peft, build_model, make_optimizer

        self.r, self.train, self.device = recipe, train, torch.device(recipe.device)
        torch.manual_seed(seed)
        self.m = build_model(recipe.model, recipe.dtype, self.device)
        apply_peft(self.m, recipe.dtype, recipe.lora_rank, recipe.lora_targets, recipe.quant,
                   recipe.lisa_layers, quant_set=recipe.quant_set)
        self.opt = make_optimizer(self.m, recipe, lr)
        self.before = None
        if recipe.lisa_layers:
            from labkit.peft import LISA

            self.before = LISA(self.m, self.opt, gamma=recipe.lisa_layers, interval=LISA_INTERVAL, seed=seed).step
        self.gen = torch.Generator().manual_seed(seed)  # the same batches for every technique
        self.times: list[float] = []

    def step(self) -> None:
        from labkit.data import get_batch
        from labkit.run import train_step

        r = self.r
        x, y = get_batch(self.train, r.batch, r.seq, device=self.device, generator=self.gen)
        cuda = self.device.type == "cuda"
        wrap = contextlib.nullcontext()
        if r.checkpoint != "none":
            from labkit.recompute import checkpoint_blocks

            wrap = checkpoint_blocks(self.m, r.checkpoint)
        with wrap:  # entered outside the timed region
            if cuda:  # time this step's kernels only: wait for earlier work, then for this step's
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            if self.before is not None:
                self.before()
            train_step(self.m, self.opt, x, y, r.dtype, r.micro_batch, r.offload_activations)
            if cuda:
                torch.cuda.synchronize(self.device)
            self.times.append(time.perf_counter() - t0)

    def val_loss(self, val_batches) -> float:
        self.m.eval()
        with torch.no_grad():
            return statistics.fmean(float(self.m(x.to(self.device), y.to(self.device))) for x, y in val_batches)

    def close(self) -> None:
        if hasattr(self.opt, "close"):
            self.opt.close()


def machine() -> dict:
    """What ran the bench: CPU, cores, torch threads, torch version, platform."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def run_matrix(size="default", steps: int | None = None, seed: int = 0, progress=None, keys=None,
               device=None) -> dict:
    """Measure the baseline and every technique (see the module's docstring); returns the matrix as a dict
    (what data/selection_matrix.json holds). progress: a callable given one line per technique, or None.
    keys: the techniques to measure (TECHNIQUE_KEYS, in that order, by default); a lesson measures a few.
    device: where to train and time ("cpu" by default, or "cuda")."""
    kind = torch.device(device or "cpu").type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    chosen = TECHNIQUE_KEYS if keys is None else tuple(keys)
    unknown = [k for k in chosen if k not in TECHNIQUE_KEYS]
    if unknown or not chosen:
        raise ValueError(f"keys: unknown technique(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose from "
                         f"{', '.join(TECHNIQUE_KEYS)}")
    from labkit.data import get_batch, load_tokens
    from labkit.run import measure_step

    z = _size(size)
    steps = z["steps"] if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 3:
        raise ValueError(f"steps must be an integer >= 3 (two warm-up steps, then timed ones), got {steps!r}")
    max_chars = 200_000 if z is SIZES["smoke"] else 2_000_000
    train, val, _ = load_tokens(max_chars=max_chars)
    vgen = torch.Generator().manual_seed(seed + 1)
    val_batches = [get_batch(val, z["batch"], z["seq"], generator=vgen) for _ in range(z["val_batches"])]
    keys = [("baseline", "fp32 AdamW (baseline)")] + [(k, lab) for k, lab, _ in TECHNIQUES if k in chosen]
    rows, trainers = [], []
    before = machine()
    if kind == "cuda":
        before["gpu"] = torch.cuda.get_device_name()
    try:
        for key, label in keys:  # memory: two steps under the Ledger
            t0 = time.perf_counter()
            r = technique_recipe(key, z).replace(device=kind)
            meas = measure_step(r, steps=2, data=train, seed=seed)
            lr = LION_LR if r.optimizer == "lion" else LR
            opts = {k: v for k, v in r.options().items() if v != Recipe(r.model, r.batch, r.seq).options()[k]}
            opts.update({f"model.{k}": v for k, v in vars(r.model).items() if getattr(_config(z), k) != v})
            rows.append({"key": key, "label": label, "options": opts,
                         "lr": None if r.optimizer == "adafactor" else lr,
                         "peak_bytes": int(meas.peak.total), "peak_phase": meas.peak_phase,
                         "peak_by_category": {c.name.lower(): int(meas.peak[c]) for c in CATEGORIES},
                         "category_max": _category_max(meas)})
            trainers.append(_Trainer(r, lr, train, seed))
            if progress is not None:
                progress(f"{label:42s} peak {meas.peak.total / 2**20:7.2f} MiB  ({time.perf_counter() - t0:.1f} s)")
        for _ in range(steps):  # time and loss: one step of each technique per round
            for t in trainers:
                t.step()
        for row, t in zip(rows, trainers):
            row["step_s"] = statistics.median(t.times[2:])
            row["step_min_s"] = min(t.times[2:])
            row["val_loss"] = t.val_loss(val_batches)
            if progress is not None:
                progress(f"{row['label']:42s} step {row['step_s'] * 1e3:7.1f} ms (median)  val loss {row['val_loss']:.4f}")
    finally:
        for t in trainers:
            t.close()
    base = rows[0]
    cfg = _config(z)
    for row in rows[1:]:
        row["saved_bytes"] = base["peak_bytes"] - row["peak_bytes"]
        row["saved_frac"] = row["saved_bytes"] / base["peak_bytes"]
        row["time_ratio"] = row["step_s"] / base["step_s"]
        row["loss_delta"] = row["val_loss"] - base["val_loss"]
        diff = {c: base["category_max"][c] - row["category_max"][c] for c in base["category_max"]}
        floor = 0.01 * base["peak_bytes"]  # a change under 1 % of the baseline's peak is not a cut
        row["cuts"] = [c for c in sorted(diff, key=lambda c: -diff[c]) if diff[c] > floor]
        row["adds"] = [c for c in sorted(diff, key=lambda c: diff[c]) if -diff[c] > floor]
        top = row["cuts"][0] if row["cuts"] else None
        row["wins_when"] = (None if top is None else "activation-bound"
                            if top in [c.name.lower() for c in ACTIVATION_CATEGORIES] else "state-bound")
    B, S = z["batch"], z["seq"]
    grid = [regime(cfg, b, s) for b in (1, B, 4 * B) for s in (S // 4, S)]
    return {
        "what": "memory saved, time cost and loss effect of each technique against fp32 AdamW, measured",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": dict(before, load_average_1min_end=machine()["load_average_1min"]),
        "size": "custom" if isinstance(size, dict) else size,
        "device": kind,
        "config": {"model": dict(z["model"]), "batch": B, "seq": S, "steps": steps, "seed": seed,
                   "data": "Shakespeare (labkit.data.load_tokens, byte tokens)", "val_batches": z["val_batches"],
                   "memory": "labkit.run.measure_step, 2 steps, Ledger peak (logical bytes)",
                   "time": "median wall clock of steps 3..N, no Ledger; the techniques' steps interleaved round by round", "lr": LR, "lion_lr": LION_LR,
                   "notes": ["trained from random weights: adapter methods (LoRA, QLoRA) train few parameters and are made "
                             "for fine-tuning, so their loss effect here is an upper bound",
                             "optimizer offload (cpu): the Ledger counts the training device's bytes; on a CPU run the "
                             "host is the same memory, so its saving is what it saves on a GPU, not on this machine",
                             "step-in-backward cuts the gradients, which are not part of the peak when the peak is the "
                             "start of backward (activation-bound); it wins when the gradients are at the peak"]},
        "regime": regime(cfg, B, S),
        "regimes": grid,
        "baseline": base,
        "techniques": rows[1:],
    }


def save_matrix(matrix: dict, path=None) -> Path:
    """Write the matrix as JSON (default data/selection_matrix.json); returns the path."""
    path = Path(MATRIX_FILE if path is None else path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(matrix, indent=1) + "\n")
    return path


def load_matrix(path=None) -> dict:
    """The matrix a bench run wrote (default: the committed data/selection_matrix.json)."""
    path = Path(MATRIX_FILE if path is None else path)
    if not path.is_file():
        raise FileNotFoundError(f"no selection matrix at {path}: run python bench/selection_matrix.py")
    m = json.loads(path.read_text())
    missing = {"machine", "date", "baseline", "techniques", "regime"} - set(m)
    if missing:
        raise ValueError(f"{path} is not a selection matrix: it lacks {', '.join(sorted(missing))}")
    return m


COLUMNS = ("technique", "memory saved", "saved %", "time x", "loss delta", "cuts", "wins when")


def measured_on(matrix: dict) -> str:
    """The device the matrix's times were measured on, in words ("cpu (AMD EPYC, 2 cores)", "cuda (NVIDIA ...)")."""
    kind, mach = matrix.get("device", "cpu"), matrix["machine"]
    if kind == "cuda" and mach.get("gpu"):
        return f"cuda ({mach['gpu']})"
    return f"cpu ({mach['cpu']}, {mach['cores']} cores)"


def predicted_gpu(matrix: dict, preset: str = "a10") -> dict[str, dict]:
    """Per technique (and "baseline"), labkit.plan.cost's predicted step on a GPU preset for the matrix's recipes:
    {"time_x": over the baseline's predicted step, "parts": seconds by part, "host_bytes": bytes over the host
    link, "made_of": the largest part that differs from the baseline's, in words}. Predicted, not measured."""
    from labkit.estimate.spec import spec_from
    from labkit.memory.units import fmt_bytes

    from . import cost
    from .devices import get_device
    from .search import _Search

    dev = get_device(preset)
    z = {k: matrix["config"][k] for k in ("model", "batch", "seq")}
    out = {}
    for key in ("baseline",) + tuple(r["key"] for r in matrix["techniques"]):
        r = technique_recipe(key, z).replace(device="cuda")
        spec = spec_from(r.model)
        s = _Search(r.model, spec, dev.memory, dev, r.batch, r.seq)
        act = s.act_row(r, r.checkpoint) * r.micro if r.offload_activations else 0.0
        t = s.time(r)
        out[key] = {"parts": t.parts(), "total": t.total,
                    "host_bytes": cost.host_link_bytes(r.replace(model=spec), spec, act)}
    base = out["baseline"]
    for key, v in out.items():
        v["time_x"] = v["total"] / base["total"]
        diff = {k: v["parts"][k] - base["parts"][k] for k in v["parts"]}
        k = max(diff, key=lambda k: abs(diff[k]))
        if k == "host" and v["host_bytes"]:
            link = v["host_bytes"] / dev.host_bw
            v["made_of"] = (f"host {v['parts']['host'] * 1e3:.2f} ms: {fmt_bytes(v['host_bytes'])} / "
                            f"{dev.host_bw / 1e9:.0f} GB/s ({dev.host_link}) = {link * 1e3:.2f} ms"
                            + (" + the step in host memory" if v["parts"]["host"] > link * 1.001 else ""))
        else:
            v["made_of"] = f"{k} {diff[k] * 1e3:+.3f} ms" if abs(diff[k]) > 0 else "-"
    return out


def matrix_table(matrix: dict | None = None) -> list[dict]:
    """One row per technique: {technique, memory saved (bytes), saved % of the baseline's peak, time x (step time
    over the baseline's), loss delta (val loss minus the baseline's), cuts (categories), wins when (regime)}."""
    m = load_matrix() if matrix is None else matrix
    return [{"technique": r["label"], "memory saved": r["saved_bytes"], "saved %": 100 * r["saved_frac"],
             "time x": r["time_ratio"], "loss delta": r["val_loss"] - m["baseline"]["val_loss"],
             "cuts": ", ".join(r["cuts"]) or "-", "wins when": r["wins_when"] or "-"} for r in m["techniques"]]


def format_table(matrix: dict | None = None, gpu: str | None = None) -> str:
    """matrix_table as aligned text, its time column measured on the matrix's device (named above the table); with
    gpu (a labkit.plan.devices preset) two more columns: the predicted time x on that GPU and what it is made of."""
    from .devices import get_device

    m = load_matrix() if matrix is None else matrix
    rows = matrix_table(m)
    pred = predicted_gpu(m, gpu) if gpu else None
    head = f"memory: the Ledger's logical bytes; time x: measured on {measured_on(m)}"
    if pred:
        head += f"; GPU x: PREDICTED for {get_device(gpu).title} by labkit.plan.cost (not measured)"
    lines = [head, f"{'technique':42s} {'saved':>9s} {'saved %':>8s} {'time x':>7s} {'loss d':>7s}  {'cuts':30s} "
             + ("wins when" if not pred else f"{'wins when':17s} {'GPU x':>6s}  GPU cost made of")]
    for r, t in zip(rows, m["techniques"]):
        line = (f"{r['technique']:42s} {r['memory saved'] / 2**20:7.2f}Mi {r['saved %']:7.1f}% {r['time x']:7.2f} "
                f"{r['loss delta']:+7.3f}  {r['cuts']:30s} ")
        if pred:
            p = pred[t["key"]]
            line += f"{r['wins when']:17s} {p['time_x']:6.2f}  {p['made_of']}"
        else:
            line += r["wins when"]
        lines.append(line.rstrip())
    return "\n".join(lines)


def plot_matrix(matrix: dict | None = None, ax=None):
    """Memory saved (% of the baseline's peak) against time cost (step time / the baseline's), one labelled
    point per technique, coloured by the regime where it wins. Returns the figure: a matplotlib Figure that
    pyplot does not hold, so a notebook shows it once, where it is displayed (a pyplot figure would be drawn
    again by the inline backend at the cell's end)."""
    from matplotlib.figure import Figure

    m = load_matrix() if matrix is None else matrix
    if ax is None:
        fig = Figure(figsize=(8, 5.5))
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    colours = {"activation-bound": "tab:orange", "state-bound": "tab:blue", None: "tab:gray"}
    legend = {"activation-bound": "largest cut: activations (wins when activation-bound)",
              "state-bound": "largest cut: model states (wins when state-bound)", None: "no measurable cut"}
    pts = [(r["time_ratio"], 100 * r["saved_frac"], r) for r in m["techniques"]]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    xr, yr = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    char, dy = xr / 95, 0.045 * yr  # about one 8-point character, one line, in data units
    boxes: list[tuple[float, float, float]] = []  # placed labels: (x from, x to, y)
    for x, y, r in sorted(pts, key=lambda p: (-p[1], p[0])):
        ax.scatter([x], [y], color=colours[r["wins_when"]], s=36, zorder=3)
        x0, x1, ly = x + 0.012 * xr, x + 0.012 * xr + char * len(r["label"]), y + 0.01 * yr
        while any(a < x1 and x0 < b and abs(ly - c) < dy for a, b, c in boxes):  # move below the labels in the way
            ly -= dy
        ax.annotate(r["label"], (x, y), xytext=(x0, ly), fontsize=8, va="bottom",
                    arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5") if abs(ly - y) > dy else None)
        boxes.append((x0, x1, ly))
    ax.set_xlim(min(min(xs), 1.0) - 0.05 * xr, max(max(b for _, b, _ in boxes), 1.0) + 0.02 * xr)  # labels inside
    for name in sorted({r["wins_when"] for r in m["techniques"]}, key=str):
        ax.scatter([], [], color=colours[name], label=legend[name])
    ax.axhline(0, color="k", lw=0.6)
    ax.axvline(1, color="k", lw=0.6, ls=":")
    cfg = m["config"]
    ax.set_xlabel(f"time per step / fp32 AdamW's, measured on {measured_on(m)}"
                  + (": offload moves nothing on a CPU (not a GPU's cost)" if m.get("device", "cpu") == "cpu" else ""))
    ax.set_ylabel("peak memory saved (% of fp32 AdamW's)")
    ax.set_title(f"Techniques on a GPT ({cfg['model']['n_layer']} x {cfg['model']['n_embd']}), B={cfg['batch']} "
                 f"S={cfg['seq']}: {m['regime']['regime']}; times measured on {measured_on(m)}", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    ax.grid(alpha=0.3)
    return fig

