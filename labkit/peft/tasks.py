"""Real offline tasks for the PEFT lesson: classify Shakespeare passages with MiniLM, and adapt a GPT from comedies to histories.

(a) `classify_task`: passages of 16-32 spoken words (see `labkit.peft.passages`) from the 35 plays
of the First Folio, which exist here in two spellings. task="spelling" (default) asks "First Folio
(1623) or modern spelling?" (vpon/haue/loue, Capitalised Nouns); task="genre" asks comedy / history
/ tragedy, a much harder question that barely moves in a CPU budget. Whole plays are held out for
testing. all-MiniLM-L6-v2 and a linear head on its mean-pooled hidden states is first trained
head-only on frozen features (the "before" accuracy: a linear probe); full fine-tuning, LoRA and
QLoRA then start from that head and see fresh training passages at every step.
(b) `adapt_task`: labkit's GPT pretrained briefly on the comedies, then adapted to the histories
with LoRA, QLoRA, LISA (and full fine-tuning for reference): validation loss on held-out history
text before and after.

Both also run the libraries' versions as references (`labkit.peft.reference`): "peft-lora" (peft's
LoRA on the same targets, rank and alpha), "bnb-qlora" (bitsandbytes Linear4bit NF4 + peft's LoRA)
and, in adapt_task, "lisa-naive" (LISANaive: the reference callback that never frees a frozen
layer's optimizer state). A method and its reference start from the same adapter values and see the
same batches and dropout masks, measured over the same steps. Every method's peak memory is
measured with the Ledger on its first `measure_steps` steps (LISA's over two layer switches); its
step time is the median of the steps after those.

Each task takes its question and sizes as one config (`ClassifyTask`, `AdaptTask`; a size left None is the
tier's: smoke, cpu or cuda) and how the methods train as another (`Adaptation`), e.g.
`adapt_task(AdaptTask(steps=20), adaptation=Adaptation(r=4))`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.device import smoke
from .lisa import LISA, LISANaive
from .lora import LoRAConfig, _check_rank, count_parameters, find_targets, linear_names, trainable_parameters
from .passages import FOLIO_GENRES, FOLIO_IDS, GENRES, TASK_CLASSES, passages, speech_words  # noqa: F401 (re-exported)
from .qlora import COMPUTE_DTYPES, qlora_optimizer
from .runs import REFERENCES, TaskResult, adapted, check_methods, fit, format_results, learning_rates, result  # noqa: F401

CLASSIFY_METHODS = ("full", "lora", "qlora", "peft-lora", "bnb-qlora")
ADAPT_METHODS = ("full", "lora", "qlora", "lisa", "peft-lora", "bnb-qlora", "lisa-naive")
QLORA_OPTIMIZERS = ("adamw", "adamw8bit")  # qlora_optimizer's kinds
GPT_ONLY = ("qlora_checkpoint", "qlora_optim", "gamma", "interval")  # Adaptation fields only adapt_task reads


def _check_sizes(config, names) -> None:
    """A task config's sizes: each None (the tier's) or a positive integer."""
    for name in names:
        v = getattr(config, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{name} must be a positive integer (or None: the tier's), got {v!r}")


@dataclass(frozen=True)
class Adaptation:
    """How the methods train, in either task (classify_task refuses the GPT_ONLY fields)."""

    r: int = 8  # LoRA's rank (lora, qlora and their references)
    alpha: float = 16  # LoRA's alpha: the update is scaled by alpha / r
    lr: dict | None = None  # learning rates by method over the task's defaults; a reference takes its method's
    seed: int = 0  # the model's or head's init, the batches, the adapters' values and the dropout masks
    measure_steps: int = 2  # steps measured under the Ledger (LISA's: at least two layer switches)
    qlora_dtype: torch.dtype | None = None  # NF4's compute dtype (None: bf16 on CUDA; fp32 elsewhere, where
    #   CPUs without bf16 units emulate it slowly)
    qlora_checkpoint: str | None = None  # labkit's QLoRA: a checkpoint_blocks policy (bnb-qlora never checkpoints)
    qlora_optim: str = "adamw"  # both QLoRAs' optimizer: one of QLORA_OPTIMIZERS
    gamma: int = 1  # LISA: blocks trained at a time
    interval: int | None = None  # LISA: steps between switches (None: steps // 5)

    def __post_init__(self) -> None:
        from labkit.recompute import POLICIES

        _check_rank(self.r, self.alpha)
        for name, least in (("seed", 0), ("measure_steps", 0), ("gamma", 1), ("interval", 1)):
            v = getattr(self, name)
            if not (name == "interval" and v is None) and (isinstance(v, bool) or not isinstance(v, int) or v < least):
                raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")
        if self.qlora_dtype is not None and self.qlora_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"qlora_dtype must be None or one of {COMPUTE_DTYPES}, got {self.qlora_dtype!r}")
        if self.qlora_checkpoint is not None and self.qlora_checkpoint not in POLICIES:
            raise ValueError(f"qlora_checkpoint must be None or one of {', '.join(POLICIES)}, "
                             f"got {self.qlora_checkpoint!r}")
        if self.qlora_optim not in QLORA_OPTIMIZERS:
            raise ValueError(f"qlora_optim must be one of {', '.join(QLORA_OPTIMIZERS)}, got {self.qlora_optim!r}")

    def qdtype(self, device: torch.device) -> torch.dtype:
        return self.qlora_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


# ---- (a) the classification task ------------------------------------------------------------------
class MeanPoolClassifier(nn.Module):
    """An encoder, the attention-masked mean of its last hidden states, and a linear head."""

    def __init__(self, encoder: nn.Module, n_classes: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, n_classes)

    def features(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, H)
        m = mask.unsqueeze(-1).to(h.dtype)  # (B, T, 1)
        return (h * m).sum(1) / m.sum(1).clamp_min(1)  # (B, H)

    def forward(self, ids, mask, labels=None):
        logits = self.head(self.features(ids, mask).float())  # (B, classes)
        return logits if labels is None else F.cross_entropy(logits, labels)


@torch.no_grad()
def _accuracy(model, data, batch: int = 64) -> float:
    model.eval()
    ids, mask, y = data
    pred = torch.cat([model(ids[i:i + batch], mask[i:i + batch]).argmax(-1) for i in range(0, len(y), batch)])
    model.train()
    return (pred == y).float().mean().item()


CLASSIFY_SIZES = {  # smoke: seconds (CI); cpu: a few CPU minutes a method; cuda: a real run
    "smoke": dict(words=16, max_length=24, probe_per_class=16, train_per_class=64, test_per_class=16, steps=4, batch=4),
    "cpu": dict(words=32, max_length=48, probe_per_class=200, train_per_class=3000, test_per_class=100, steps=60, batch=16),
    "cuda": dict(words=32, max_length=64, probe_per_class=1000, train_per_class=6000, test_per_class=300, steps=300, batch=32),
}


def _tier(smoke_mode, device: torch.device) -> str:
    return "smoke" if (smoke() if smoke_mode is None else smoke_mode) else "cuda" if device.type == "cuda" else "cpu"


def _device(device) -> torch.device:
    from labkit.device import pick_device

    return pick_device(device) if device is None or isinstance(device, str) else torch.device(device)


@dataclass(frozen=True)
class ClassifyTask:
    """classify_task's question and sizes; a size left None is the tier's (CLASSIFY_SIZES)."""

    task: str = "spelling"  # "spelling" (First Folio or modern) or "genre" (comedy, history, tragedy); see `passages`
    words: int | None = None  # spoken words per passage
    max_length: int | None = None  # tokens per passage after padding or truncation
    probe_per_class: int | None = None  # passages per class the linear probe is fitted on
    train_per_class: int | None = None  # the pool per class that fine-tuning draws its batches from
    test_per_class: int | None = None  # held-out passages per class
    steps: int | None = None  # fine-tuning steps per method
    batch: int | None = None  # passages per step

    def __post_init__(self) -> None:
        if self.task not in TASK_CLASSES:
            raise ValueError(f"unknown task {self.task!r}: choose among {', '.join(TASK_CLASSES)}")
        _check_sizes(self, CLASSIFY_SIZES["cpu"])


def classify_task(task: ClassifyTask = ClassifyTask(), methods=("full", "lora", "qlora"), model=None,
                  adaptation: Adaptation = Adaptation(), smoke_mode: bool | None = None,
                  device=None) -> dict[str, TaskResult]:
    """Fine-tune MiniLM on a passage task from a linear probe's head; {"probe": ..., method: TaskResult}.

    model: None (the bundled all-MiniLM-L6-v2), a hub name or folder (online users), or a (model, tokenizer) pair.
    device: default labkit.device.pick_device() (LABKIT_DEVICE, else the best there is).
    """
    from labkit.models.minilm import load_minilm

    check_methods(methods, CLASSIFY_METHODS)
    gpt_only = [f for f in GPT_ONLY if getattr(adaptation, f) != getattr(Adaptation(), f)]
    if gpt_only:
        raise ValueError(f"{', '.join(gpt_only)}: adapt_task's only (classify_task trains every method with AdamW, "
                         f"no LISA)")
    device = _device(device)
    s = {**CLASSIFY_SIZES[_tier(smoke_mode, device)],
         **{k: getattr(task, k) for k in CLASSIFY_SIZES["cpu"] if getattr(task, k) is not None}}
    a, task = adaptation, task.task
    train, test = passages(task, s["words"], s["train_per_class"], s["test_per_class"])
    lr = learning_rates({"probe": 1e-2, "full": 5e-5, "lora": 1e-3, "qlora": 1e-3}, a.lr)
    encoder, tok = model if isinstance(model, tuple) else load_minilm(model)
    encoder = encoder.to(device)

    def encode(rows):
        enc = tok([row[0] for row in rows], padding="max_length", truncation=True, max_length=s["max_length"], return_tensors="pt")
        return enc["input_ids"].to(device), enc["attention_mask"].to(device), torch.tensor([row[1] for row in rows], device=device)

    tr, te = encode(train), encode(test)
    n_cls = len(TASK_CLASSES[task])
    probe = torch.cat([(tr[2] == c).nonzero().flatten()[:s["probe_per_class"]] for c in range(n_cls)])  # (P,)
    torch.manual_seed(a.seed)
    base = MeanPoolClassifier(encoder, n_cls).to(device)
    with torch.no_grad():  # before: a linear probe on frozen mean-pooled features, the head every method starts from
        base.eval()
        feats = torch.cat([base.features(tr[0][i], tr[1][i]) for i in probe.split(64)])  # (P, hidden)
    opt = torch.optim.AdamW(base.head.parameters(), lr=lr["probe"])
    for _ in range(300):
        F.cross_entropy(base.head(feats), tr[2][probe]).backward()
        opt.step()
        opt.zero_grad()
    before = _accuracy(base, te)
    results = {"probe": TaskResult("probe", "accuracy", 1 / n_cls, before, base.head.weight.numel() + n_cls,
                                   count_parameters(base).total, None, 0.0)}
    targets = [n for n in linear_names(base) if "pooler" not in n and not n.startswith("head")]  # the pooler is unused
    lora = LoRAConfig(targets, r=a.r, alpha=a.alpha, train_also=("head",))
    for method in methods:
        model = adapted(base, method, lora, a.qdtype(device), a.seed)
        for name, mod in model.named_modules():
            if name.rsplit(".", 1)[-1] == "pooler":
                mod.requires_grad_(False)  # BERT's pooler is not on the mean-pooled path: it would get no gradient
        opt = torch.optim.AdamW(trainable_parameters(model), lr=lr[method])
        g = torch.Generator().manual_seed(a.seed)
        order = [torch.randint(len(tr[2]), (s["batch"],), generator=g).to(device) for _ in range(s["steps"])]
        run = fit(model, opt, lambda i: model(tr[0][order[i]], tr[1][order[i]], tr[2][order[i]]), s["steps"],
                  a.measure_steps, seed=a.seed + 3)
        results[method] = result(method, "accuracy", before, _accuracy(model, te), model, run)
    return results


# ---- (b) adapting a GPT to another part of the corpus --------------------------------------------
_PRETRAINED: dict = {}  # (config, steps, source, seed) -> state_dict: pretrain once per session


def _genre_tokens(genre: str, max_chars: int | None):
    from labkit.data import ByteTokenizer, corpus, train_val_split

    return train_val_split(ByteTokenizer().encode(corpus(plays=[p + "_gut" for p in FOLIO_GENRES[genre]], max_chars=max_chars)))


@dataclass(frozen=True)
class AdaptTask:
    """adapt_task's genres, model and sizes; a size left None is the tier's (smoke, cpu or cuda)."""

    source: str = "comedy"  # the genre the GPT is pretrained on (FOLIO_GENRES)
    target: str = "history"  # the genre it is adapted to and validated on
    cfg: object = None  # a GPTConfig (None: smoke profile's; on CPU 4 layers of 128; on CUDA the device profile's)
    pretrain_steps: int | None = None  # steps of pretraining on `source` (once per session and setting)
    steps: int | None = None  # adaptation steps per method
    batch: int | None = None  # rows per step (None: the device profile's)
    seq: int | None = None  # tokens per row (None: the profile's, at most cfg.block_size)

    def __post_init__(self) -> None:
        for g in (self.source, self.target):
            if g not in FOLIO_GENRES:
                raise ValueError(f"unknown genre {g!r}: choose among {', '.join(GENRES)}")
        _check_sizes(self, ("pretrain_steps", "steps", "batch", "seq"))


def adapt_task(task: AdaptTask = AdaptTask(), methods=("lora", "qlora", "lisa"), adaptation: Adaptation = Adaptation(),
               smoke_mode: bool | None = None, device=None) -> dict[str, TaskResult]:
    """Pretrain a GPT on `source` plays, adapt it to `target` plays; validation loss on `target` before and after.

    methods: any of ADAPT_METHODS: "full", "lora", "qlora", "lisa" and the references "peft-lora",
    "bnb-qlora", "lisa-naive". LISA trains adaptation.gamma of the blocks, switching every `interval` steps
    (default steps // 5), plus the embeddings and final norm; LISA and LISANaive are measured over
    max(measure_steps, 2 * interval + 1) steps (two switches), the others over measure_steps.
    """
    from labkit.data import get_batch
    from labkit.device import profile
    from labkit.models.gpt import GPT, GPTConfig

    check_methods(methods, ADAPT_METHODS)
    a, t, device = adaptation, task, _device(device)
    seed = a.seed
    tier = _tier(smoke_mode, device)
    small = tier == "smoke"
    prof = profile(device, smoke_mode=small)
    cfg = t.cfg or (GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128) if tier == "cpu" else prof.gpt_config())
    pretrain_steps = t.pretrain_steps or {"smoke": 40, "cpu": 400, "cuda": 1000}[tier]
    steps, batch = t.steps or {"smoke": 8, "cpu": 60, "cuda": 200}[tier], t.batch or prof.batch
    seq = min(t.seq or prof.seq, cfg.block_size)
    interval = a.interval or max(1, steps // 5)
    lr = learning_rates({"pretrain": 3e-3, "full": 1e-3, "lora": 3e-3, "qlora": 3e-3, "lisa": 1e-3}, a.lr)
    max_chars = 300_000 if small else None
    src, _ = _genre_tokens(t.source, max_chars)
    tgt_train, tgt_val = _genre_tokens(t.target, max_chars)

    key = (repr(cfg), pretrain_steps, t.source, seed, max_chars, batch, seq, str(device))
    torch.manual_seed(seed)
    base = GPT(cfg).to(device)
    if key not in _PRETRAINED:
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(base.parameters(), lr=lr["pretrain"])
        fit(base, opt, lambda i: base(*get_batch(src, batch, seq, device, generator=g)), pretrain_steps, 0, seed=seed)
        _PRETRAINED[key] = copy.deepcopy(base.state_dict())
    base.load_state_dict(_PRETRAINED[key])

    gv = torch.Generator().manual_seed(seed + 1)
    val = [get_batch(tgt_val, batch, seq, device, generator=gv) for _ in range(4 if small else 16)]

    @torch.no_grad()
    def val_loss(m):
        m.eval()
        out = sum(m(x, y).item() for x, y in val) / len(val)
        m.train()
        return out

    before = val_loss(base)
    results = {}
    lora = LoRAConfig(find_targets(base, "all-linear"), r=a.r, alpha=a.alpha)
    gt = torch.Generator().manual_seed(seed + 2)
    batches = [get_batch(tgt_train, batch, seq, device, generator=gt) for _ in range(steps)]
    for method in methods:
        model = adapted(base, method, lora, a.qdtype(device), seed, checkpoint=a.qlora_checkpoint)
        lisa, measured = None, a.measure_steps
        if method in ("qlora", "bnb-qlora"):
            opt = qlora_optimizer(model, a.qlora_optim, lr=lr[method])
        elif method in ("lisa", "lisa-naive"):
            opt = torch.optim.AdamW(model.parameters(), lr=lr[method])
            lisa = (LISA if method == "lisa" else LISANaive)(model, opt, gamma=a.gamma, interval=interval, seed=seed)
            measured = max(a.measure_steps, min(steps, 2 * interval + 1))  # see the switches free (or keep) state
        else:
            opt = torch.optim.AdamW(trainable_parameters(model), lr=lr[method])
        run = fit(model, opt, lambda i: model(*batches[i]), steps, measured, before_step=lisa.step if lisa else None,
                  seed=seed + 3)
        trainable = sum(p.numel() for p in lisa.active_parameters()) if lisa else None
        results[method] = result(method, "val_loss", before, val_loss(model), model, run, trainable)
    return results
