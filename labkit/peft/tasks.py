"""Real offline tasks for the PEFT lesson: classify Shakespeare passages with MiniLM, and adapt a GPT from comedies to histories.

(a) `classify_task`: passages of 16-32 spoken words (speaker names and stage directions removed)
from the 35 plays of the First Folio, which exist here in two spellings. task="spelling" (default)
asks "First Folio (1623) or modern spelling?" (vpon/haue/loue, Capitalised Nouns); task="genre" asks
comedy / history / tragedy after the Folio's catalogue, a much harder question that barely moves in
a CPU budget. Whole plays are held out for testing (in each genre's alphabetical list every 4th
play, in both spellings), so names and plots cannot be learned by heart. all-MiniLM-L6-v2 and a
linear head on its mean-pooled hidden states is first trained head-only on frozen features (the
"before" accuracy: a linear probe); full fine-tuning, LoRA and QLoRA then start from that head and
see fresh training passages at every step.
(b) `adapt_task`: labkit's GPT pretrained briefly on the comedies, then adapted to the histories
with LoRA, QLoRA, LISA (and full fine-tuning for reference): validation loss on held-out history
text before and after. Every method's peak memory is measured with the Ledger on its first steps.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import re
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.device import smoke
from labkit.memory import Ledger
from .lisa import LISA
from .lora import apply_lora, count_parameters, linear_names, trainable_parameters
from .qlora import apply_qlora, qlora_optimizer

FOLIO_GENRES = {  # modern-spelling ids without "_gut"; Troilus and Cressida (uncatalogued) and Pericles (not in the Folio) left out
    "comedy": ("tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure", "comedy_of_errors",
               "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream", "merchant_of_venice",
               "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well", "twelfth_night", "winters_tale"),
    "history": ("john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
                "henry_vi_part_2", "henry_vi_part_3", "richard_iii", "henry_viii"),
    "tragedy": ("coriolanus", "tragedy_of_titus_andronicus", "romeo_and_juliet", "timon_of_athens", "julius_caesar",
                "macbeth", "hamlet", "lear", "othello", "antony_and_cleopatra", "cymbeline"),
}
FOLIO_IDS = {"comedy_of_errors": "comedy_of_errours", "loves_labours_lost": "loves_labour_lost",  # where names differ
             "midsummer_nights_dream": "midsummer_nights_dreame", "alls_well_that_ends_well": "all_is_well_that_ends_well",
             "twelfth_night": "twelfe-night", "tragedy_of_titus_andronicus": "titus_andronicus",
             "antony_and_cleopatra": "anthonie_and_cleopatra"}
GENRES = tuple(sorted(FOLIO_GENRES))
TASK_CLASSES = {"spelling": ("modern", "folio"), "genre": GENRES}


@dataclass
class TaskResult:
    method: str  # "probe", "full", "lora", "qlora", "lisa"
    metric: str  # "accuracy" (higher is better) or "val_loss" (lower is better)
    before: float  # the metric before this method trained
    after: float  # and after
    trainable: int  # parameter elements with gradients and optimizer state
    total: int  # all parameter elements (NF4 codes count as stored: 2 weights per uint8)
    peak: object  # labkit.memory Breakdown at the peak of the measured steps (None if not measured)
    seconds: float  # wall time of the training loop

    def row(self) -> str:
        peak = "-" if self.peak is None else f"{self.peak.total / 2**20:8.1f} MiB"
        return (f"{self.method:6s} {self.metric} {self.before:.3f} -> {self.after:.3f}  trainable {self.trainable:>10,}"
                f"  peak {peak}  {self.seconds:6.1f} s")


def format_results(results: dict[str, TaskResult]) -> str:
    return "\n".join(r.row() for r in results.values())


# ---- data ---------------------------------------------------------------------------------------
_FOLIO_SKIP = re.compile(r"\s*(Enter|Exit|Exeunt|Actus|Scena|Scoena|Scaena|Flourish|Alarum|Manet|Sennet)\b", re.I)


def speech_words(text: str, folio: bool = False) -> list[str]:
    """The words spoken in a play, without speaker names, headings and (most) stage directions.

    Modern texts: blocks "SPEAKER.\nlines", [directions], ACT/SCENE headings. Folio texts: "  Spk. line",
    unbracketed "Enter ..."/"Exit" lines, "Actus Primus. Scoena Prima." headings, a title line first.
    """
    words = []
    if folio:
        for line in text.splitlines()[1:]:
            if line.strip() and not _FOLIO_SKIP.match(line):
                words += re.sub(r"^\s*[A-Z][A-Za-z]{0,7}\.\s+(?=\S)", "", line).split()  # a leading "Ham. "
        return words
    m = re.search(r"^ACT\b", text, re.M | re.I)
    for block in re.split(r"\n\s*\n", text[m.start():] if m else text):
        lines = [s.strip() for s in block.splitlines() if s.strip()]
        lines = [s for s in lines if not s.startswith("[") and not re.match(r"(ACT|SCENE)\b", s, re.I)]
        if len(lines) >= 2 and lines[0].endswith(".") and len(lines[0].split()) <= 4:
            lines = lines[1:]  # "HAMLET." or "Ber.": the speaker
        for s in lines:
            words += s.split()
    return words


@functools.lru_cache(maxsize=None)
def _play_words(play_id: str) -> tuple[str, ...]:
    from labkit.data import read_play

    return tuple(speech_words(read_play(play_id), folio=play_id.endswith("_f")))


def passages(task: str = "spelling", words: int = 32, train_per_class: int = 200, test_per_class: int = 60,
             test_every: int = 4):
    """(train, test): lists of (passage, class index, play id), balanced; test passages come from held-out plays.

    The split is deterministic: in each genre's alphabetical play list, plays at index test_every-1,
    2*test_every-1, ... are held out (both spellings); passages are consecutive `words`-word chunks,
    drawn by a seeded shuffle. Classes: TASK_CLASSES[task].
    """
    if task not in TASK_CLASSES:
        raise ValueError(f"unknown task {task!r}: choose 'spelling' (Folio or modern) or 'genre' (comedy/history/tragedy)")
    for name, v in (("words", words), ("train_per_class", train_per_class), ("test_per_class", test_per_class),
                    ("test_every", test_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "test_every" else 1):
            raise ValueError(f"{name} must be a positive integer{' of at least 2' if name == 'test_every' else ''}, got {v!r}")
    pools = {c: ([], []) for c in TASK_CLASSES[task]}  # class -> (train plays' passages, held-out plays')
    for genre in GENRES:
        for j, play in enumerate(sorted(FOLIO_GENRES[genre])):
            ids = {"modern": play + "_gut", "folio": FOLIO_IDS.get(play, play) + "_gut_f"}
            for cls, pid in ids.items() if task == "spelling" else [(genre, ids["modern"])]:
                w = _play_words(pid)
                pools[cls][j % test_every == test_every - 1].extend(
                    (" ".join(w[i:i + words]), TASK_CLASSES[task].index(cls), pid) for i in range(0, len(w) - words + 1, words))
    train, test = [], []
    for cls, (tr, te) in pools.items():
        for pool, n, out in ((tr, train_per_class, train), (te, test_per_class, test)):
            random.Random(f"{cls}{words}").shuffle(pool)
            out += pool[:n]
    return train, test


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


def _fit(model, opt, loss_at, steps: int, measure_steps: int = 2, before_step=None):
    """`steps` optimizer steps of loss_at(i); the first `measure_steps` under the Ledger. -> (Measurement, seconds)."""
    model.train()
    led = None
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if measure_steps:
            led = stack.enter_context(Ledger(model, opt))
        for i in range(steps):
            if i == measure_steps:
                stack.close()
            if before_step is not None:
                before_step()
            loss_at(i).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return (led.measurement() if led else None), time.perf_counter() - t0


CLASSIFY_SIZES = {  # smoke: seconds (CI); cpu: a few CPU minutes a method; cuda: a real run
    "smoke": dict(words=16, max_length=24, probe_per_class=16, train_per_class=64, test_per_class=16, steps=2, batch=4),
    "cpu": dict(words=32, max_length=48, probe_per_class=200, train_per_class=3000, test_per_class=100, steps=60, batch=16),
    "cuda": dict(words=32, max_length=64, probe_per_class=1000, train_per_class=6000, test_per_class=300, steps=300, batch=32),
}


def _tier(smoke_mode, device: torch.device) -> str:
    return "smoke" if (smoke() if smoke_mode is None else smoke_mode) else "cuda" if device.type == "cuda" else "cpu"


def _device(device) -> torch.device:
    from labkit.device import pick_device

    return pick_device(device) if device is None or isinstance(device, str) else torch.device(device)


def classify_task(task: str = "spelling", methods=("full", "lora", "qlora"), model=None, r: int = 8,
                  alpha: float = 16, lr: dict | None = None, smoke_mode: bool | None = None, seed: int = 0,
                  measure_steps: int = 2, qlora_dtype: torch.dtype | None = None, device=None,
                  **sizes) -> dict[str, TaskResult]:
    """Fine-tune MiniLM on a passage task from a linear probe's head; {"probe": ..., method: TaskResult}.

    task: "spelling" (First Folio or modern) or "genre" (comedy, history, tragedy); see `passages`.
    model: None (the bundled all-MiniLM-L6-v2), a hub name or folder (online users), or a (model, tokenizer) pair.
    sizes: words, max_length, probe_per_class (passages the probe is fitted on), train_per_class (the
        pool fine-tuning draws its batches from), test_per_class, steps, batch: CLASSIFY_SIZES by tier.
    device: default labkit.device.pick_device() (LABKIT_DEVICE, else the best there is).
    qlora_dtype: NF4 compute dtype (default bf16 on CUDA, fp32 elsewhere: CPUs without bf16 units emulate it slowly).
    """
    from labkit.models.minilm import load_minilm

    unknown = set(methods) - {"full", "lora", "qlora"}
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}: classify_task runs 'full', 'lora' and 'qlora'")
    bad = set(sizes) - set(CLASSIFY_SIZES["cpu"])
    if bad:
        raise TypeError(f"unknown size arguments {sorted(bad)}: classify_task takes {', '.join(CLASSIFY_SIZES['cpu'])}")
    device = _device(device)
    s = {**CLASSIFY_SIZES[_tier(smoke_mode, device)], **sizes}
    train, test = passages(task, s["words"], s["train_per_class"], s["test_per_class"])
    lr = {"probe": 1e-2, "full": 5e-5, "lora": 1e-3, "qlora": 1e-3, **(lr or {})}
    encoder, tok = model if isinstance(model, tuple) else load_minilm(model)
    encoder = encoder.to(device)

    def encode(rows):
        enc = tok([row[0] for row in rows], padding="max_length", truncation=True, max_length=s["max_length"], return_tensors="pt")
        return enc["input_ids"].to(device), enc["attention_mask"].to(device), torch.tensor([row[1] for row in rows], device=device)

    tr, te = encode(train), encode(test)
    n_cls = len(TASK_CLASSES[task])
    probe = torch.cat([(tr[2] == c).nonzero().flatten()[:s["probe_per_class"]] for c in range(n_cls)])  # (P,)
    torch.manual_seed(seed)
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
    qdtype = qlora_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    targets = [n for n in linear_names(base) if "pooler" not in n and not n.startswith("head")]  # the pooler is unused
    for method in methods:
        model = copy.deepcopy(base)
        if method == "lora":
            apply_lora(model, targets, r=r, alpha=alpha, train_also=["head"])
        elif method == "qlora":
            apply_qlora(model, targets, r=r, alpha=alpha, compute_dtype=qdtype, train_also=["head"])
        for name, mod in model.named_modules():
            if name.rsplit(".", 1)[-1] == "pooler":
                mod.requires_grad_(False)  # BERT's pooler is not on the mean-pooled path: it would get no gradient
        opt = torch.optim.AdamW(trainable_parameters(model), lr=lr[method])
        g = torch.Generator().manual_seed(seed)
        order = [torch.randint(len(tr[2]), (s["batch"],), generator=g).to(device) for _ in range(s["steps"])]
        meas, secs = _fit(model, opt, lambda i: model(tr[0][order[i]], tr[1][order[i]], tr[2][order[i]]),
                          s["steps"], measure_steps)
        n = count_parameters(model)
        results[method] = TaskResult(method, "accuracy", before, _accuracy(model, te), n.trainable, n.total,
                                     meas.peak if meas else None, secs)
    return results


# ---- (b) adapting a GPT to another part of the corpus --------------------------------------------
_PRETRAINED: dict = {}  # (config, steps, source, seed) -> state_dict: pretrain once per session


def _genre_tokens(genre: str, max_chars: int | None):
    from labkit.data import ByteTokenizer, corpus, train_val_split

    return train_val_split(ByteTokenizer().encode(corpus(plays=[p + "_gut" for p in FOLIO_GENRES[genre]], max_chars=max_chars)))


def adapt_task(methods=("lora", "qlora", "lisa"), source: str = "comedy", target: str = "history", cfg=None,
               pretrain_steps: int | None = None, steps: int | None = None, batch: int | None = None,
               seq: int | None = None, r: int = 8, alpha: float = 16, gamma: int = 1, interval: int | None = None,
               lr: dict | None = None, smoke_mode: bool | None = None, seed: int = 0, measure_steps: int = 2,
               qlora_checkpoint: str | None = None, qlora_optim: str = "adamw", device=None) -> dict[str, TaskResult]:
    """Pretrain a GPT on `source` plays, adapt it to `target` plays; validation loss on `target` before and after.

    methods: any of "full", "lora", "qlora", "lisa". LISA trains gamma of the blocks, switching every
    `interval` steps (default steps // 5), plus the embeddings and final norm.
    cfg: a GPTConfig (default: smoke profile's; on CPU 4 layers of 128; on CUDA the device profile's).
    """
    from labkit.data import get_batch
    from labkit.device import profile
    from labkit.models.gpt import GPT, GPTConfig

    for g in (source, target):
        if g not in FOLIO_GENRES:
            raise ValueError(f"unknown genre {g!r}: choose among {', '.join(GENRES)}")
    unknown = set(methods) - {"full", "lora", "qlora", "lisa"}
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}: choose among 'full', 'lora', 'qlora', 'lisa'")
    device = _device(device)
    tier = _tier(smoke_mode, device)
    small = tier == "smoke"
    prof = profile(device, smoke_mode=small)
    cfg = cfg or (GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128) if tier == "cpu" else prof.gpt_config())
    pretrain_steps = pretrain_steps or {"smoke": 40, "cpu": 400, "cuda": 1000}[tier]
    steps, batch = steps or {"smoke": 8, "cpu": 60, "cuda": 200}[tier], batch or prof.batch
    seq = min(seq or prof.seq, cfg.block_size)
    interval = interval or max(1, steps // 5)
    lr = {"pretrain": 3e-3, "full": 1e-3, "lora": 3e-3, "qlora": 3e-3, "lisa": 1e-3, **(lr or {})}
    max_chars = 300_000 if small else None
    src, _ = _genre_tokens(source, max_chars)
    tgt_train, tgt_val = _genre_tokens(target, max_chars)

    key = (repr(cfg), pretrain_steps, source, seed, max_chars, batch, seq, str(device))
    torch.manual_seed(seed)
    base = GPT(cfg).to(device)
    if key not in _PRETRAINED:
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(base.parameters(), lr=lr["pretrain"])
        _fit(base, opt, lambda i: base(*get_batch(src, batch, seq, device, generator=g)), pretrain_steps, 0)
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
    for method in methods:
        model = copy.deepcopy(base)
        lisa = None
        if method == "lora":
            apply_lora(model, "all-linear", r=r, alpha=alpha)
        elif method == "qlora":
            apply_qlora(model, "all-linear", r=r, alpha=alpha, checkpoint=qlora_checkpoint,
                        compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        if method == "qlora":
            opt = qlora_optimizer(model, qlora_optim, lr=lr[method])
        else:
            opt = torch.optim.AdamW(model.parameters() if method == "lisa" else trainable_parameters(model), lr=lr[method])
        if method == "lisa":
            lisa = LISA(model, opt, gamma=gamma, interval=interval, seed=seed)
        gt = torch.Generator().manual_seed(seed + 2)
        batches = [get_batch(tgt_train, batch, seq, device, generator=gt) for _ in range(steps)]
        meas, secs = _fit(model, opt, lambda i: model(*batches[i]), steps, measure_steps,
                          before_step=lisa.step if lisa else None)
        n = count_parameters(model)
        trainable = sum(p.numel() for p in lisa.active_parameters()) if lisa else n.trainable
        results[method] = TaskResult(method, "val_loss", before, val_loss(model), trainable, n.total,
                                     meas.peak if meas else None, secs)
    return results
