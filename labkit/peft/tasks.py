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
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.device import smoke
from .lisa import LISA, LISANaive
from .lora import count_parameters, find_targets, linear_names, trainable_parameters
from .passages import FOLIO_GENRES, FOLIO_IDS, GENRES, TASK_CLASSES, passages, speech_words  # noqa: F401 (re-exported)
from .qlora import qlora_optimizer
from .runs import REFERENCES, TaskResult, adapted, check_methods, fit, format_results, learning_rates, result  # noqa: F401

CLASSIFY_METHODS = ("full", "lora", "qlora", "peft-lora", "bnb-qlora")
ADAPT_METHODS = ("full", "lora", "qlora", "lisa", "peft-lora", "bnb-qlora", "lisa-naive")


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

    check_methods(methods, CLASSIFY_METHODS)
    bad = set(sizes) - set(CLASSIFY_SIZES["cpu"])
    if bad:
        raise TypeError(f"unknown size arguments {sorted(bad)}: classify_task takes {', '.join(CLASSIFY_SIZES['cpu'])}")
    device = _device(device)
    s = {**CLASSIFY_SIZES[_tier(smoke_mode, device)], **sizes}
    train, test = passages(task, s["words"], s["train_per_class"], s["test_per_class"])
    lr = learning_rates({"probe": 1e-2, "full": 5e-5, "lora": 1e-3, "qlora": 1e-3}, lr)
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
        model = adapted(base, method, targets, r, alpha, qdtype, seed, train_also=["head"])
        for name, mod in model.named_modules():
            if name.rsplit(".", 1)[-1] == "pooler":
                mod.requires_grad_(False)  # BERT's pooler is not on the mean-pooled path: it would get no gradient
        opt = torch.optim.AdamW(trainable_parameters(model), lr=lr[method])
        g = torch.Generator().manual_seed(seed)
        order = [torch.randint(len(tr[2]), (s["batch"],), generator=g).to(device) for _ in range(s["steps"])]
        meas, secs, step = fit(model, opt, lambda i: model(tr[0][order[i]], tr[1][order[i]], tr[2][order[i]]),
                                s["steps"], measure_steps, seed=seed + 3)
        results[method] = result(method, "accuracy", before, _accuracy(model, te), model, meas, secs, step, measure_steps)
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

    methods: any of ADAPT_METHODS: "full", "lora", "qlora", "lisa" and the references "peft-lora",
    "bnb-qlora", "lisa-naive". LISA trains gamma of the blocks, switching every `interval` steps
    (default steps // 5), plus the embeddings and final norm; LISA and LISANaive are measured over
    max(measure_steps, 2 * interval + 1) steps (two switches), the others over measure_steps.
    cfg: a GPTConfig (default: smoke profile's; on CPU 4 layers of 128; on CUDA the device profile's).
    qlora_checkpoint: labkit's QLoRA only (bnb-qlora never checkpoints); qlora_optim: both QLoRAs.
    """
    from labkit.data import get_batch
    from labkit.device import profile
    from labkit.models.gpt import GPT, GPTConfig

    for g in (source, target):
        if g not in FOLIO_GENRES:
            raise ValueError(f"unknown genre {g!r}: choose among {', '.join(GENRES)}")
    check_methods(methods, ADAPT_METHODS)
    device = _device(device)
    tier = _tier(smoke_mode, device)
    small = tier == "smoke"
    prof = profile(device, smoke_mode=small)
    cfg = cfg or (GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128) if tier == "cpu" else prof.gpt_config())
    pretrain_steps = pretrain_steps or {"smoke": 40, "cpu": 400, "cuda": 1000}[tier]
    steps, batch = steps or {"smoke": 8, "cpu": 60, "cuda": 200}[tier], batch or prof.batch
    seq = min(seq or prof.seq, cfg.block_size)
    interval = interval or max(1, steps // 5)
    lr = learning_rates({"pretrain": 3e-3, "full": 1e-3, "lora": 3e-3, "qlora": 3e-3, "lisa": 1e-3}, lr)
    max_chars = 300_000 if small else None
    src, _ = _genre_tokens(source, max_chars)
    tgt_train, tgt_val = _genre_tokens(target, max_chars)

    key = (repr(cfg), pretrain_steps, source, seed, max_chars, batch, seq, str(device))
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
    targets = find_targets(base, "all-linear")
    qdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gt = torch.Generator().manual_seed(seed + 2)
    batches = [get_batch(tgt_train, batch, seq, device, generator=gt) for _ in range(steps)]
    for method in methods:
        model = adapted(base, method, targets, r, alpha, qdtype, seed, checkpoint=qlora_checkpoint)
        lisa, measured = None, measure_steps
        if method in ("qlora", "bnb-qlora"):
            opt = qlora_optimizer(model, qlora_optim, lr=lr[method])
        elif method in ("lisa", "lisa-naive"):
            opt = torch.optim.AdamW(model.parameters(), lr=lr[method])
            lisa = (LISA if method == "lisa" else LISANaive)(model, opt, gamma=gamma, interval=interval, seed=seed)
            measured = max(measure_steps, min(steps, 2 * interval + 1))  # see the switches free (or keep) state
        else:
            opt = torch.optim.AdamW(trainable_parameters(model), lr=lr[method])
        meas, secs, step = fit(model, opt, lambda i: model(*batches[i]), steps, measured,
                                before_step=lisa.step if lisa else None, seed=seed + 3)
        trainable = sum(p.numel() for p in lisa.active_parameters()) if lisa else None
        results[method] = result(method, "val_loss", before, val_loss(model), model, meas, secs, step, measured, trainable)
    return results
