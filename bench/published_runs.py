"""labkit's CUDA prediction beside peak memory that others measured on GPUs and published.

    python bench/published_runs.py [--only KEY]

Each row is one published run: its source (a URL or a repository file a reader can open), the
setup as published, the figure and what it measures (torch.cuda.max_memory_allocated, reserved,
or nvidia-smi's used memory; GB = 10**9 bytes or MiB = 2**20 bytes, and how that is known), the
Recipe labkit builds for it, labkit's peak (`estimate(Recipe(..., device="cuda"))`) in the
published unit, the difference (labkit minus published, and in % of published), and what labkit
does not model for that row. Nothing is fitted: where labkit can derive the bytes of a cause from
the published setup, that allocation is printed beside the difference ("named") with what is left
after it ("left %"); otherwise the difference stands with its causes named. A row whose model
labkit does not know prints "not modelled", and a combination labkit's estimator refuses prints
"refused", each with the reason. The last line is the summary: `published_runs: rows=N
modelled=M refused=K median_abs_diff=X% max_abs_diff=Y% median_abs_left=Z%`.
"""

from __future__ import annotations

import argparse
import enum
import statistics
import sys
import textwrap
from dataclasses import dataclass, field

UNITS = {"GB": 10**9, "MiB": 2**20}  # bytes per published unit


class Measure(enum.Enum):
    """What a published figure counts (the value is the text printed)."""

    ALLOCATED = "torch.cuda.max_memory_allocated"
    RESERVED = "torch.cuda.max_memory_reserved"
    NVIDIA_SMI = "nvidia-smi / NVML used memory (the whole device)"


class Named(enum.Enum):
    """A difference whose bytes labkit derives from the published setup (never fitted)."""

    BNB_EVERY_LINEAR = ("Lightning's BitsandbytesPrecision holds every nn.Linear in NF4 (head "
                        "included); labkit's default quant_set (transformers + bitsandbytes') all "
                        "but the head: the head's bf16 - NF4 bytes")


@dataclass(frozen=True)
class Published:
    key: str
    source: str  # a URL, or a URL and the repository file, a reader can open
    setup: str  # the setup as published
    figure: float  # the published number, in `unit`
    unit: str  # a key of UNITS
    measures: Measure
    how_known: str  # how we know the unit and what it measures
    recipe: dict | None  # labkit Recipe fields (device="cuda" is added); None: not modelled
    not_modelled: str  # what labkit does not model for this row
    named: tuple = field(default=())  # Named differences derived for this row


# litgpt's finetune scripts print the peak as
#   fabric.print(f"Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB")
# (Lightning-AI/litgpt:litgpt/finetune/lora.py, after `fit` returns): GB = 10**9 bytes of
# max_memory_allocated over the whole run. `fit` runs `validate` (whole logits,
# `chunked_cross_entropy(..., chunk_size=0)`, then a sample generation with a KV cache) inside it;
# training calls `model(input_ids, lm_head_chunk_size=128)` and `chunked_cross_entropy`: the head
# and the loss in chunks, with litgpt's own GPT code (not transformers').
LITGPT_MEASURE = ("litgpt prints `Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB`"
                  " (litgpt/finetune/lora.py)")
LITGPT_OWN = ("litgpt's own model code; its chunked head + loss (lm_head_chunk_size=128; labkit "
              "charges whole logits); the validation forward (whole logits) and the sample "
              "generation (KV cache) inside the run; LoRA dropout (p=0.05) on the adapters' input")
BNB = ("bnb.nf4 is Lightning's BitsandbytesPrecision('nf4', bf16) with no ignore_modules, which "
       "replaces every nn.Linear, the head included (lightning.ai/docs/fabric/stable/api/generated/"
       "lightning.fabric.plugins.precision.BitsandbytesPrecision.html: ignore_modules are 'The "
       "submodules whose Linear layers should not be replaced'); labkit's NF4 is double-quantized; "
       "what is left after the named allocation is not derived here (bitsandbytes' 4-bit matmul "
       "under autograd and the model's load under BitsandbytesPrecision are not modelled)")

# The resource table: "Hardware: NVIDIA A100-SXM4-40GB", "LitGPT version: commit 8641822",
# "PyTorch 2.1.0+cu121", "Bitsandbytes 0.41.1", "All experiments were run using 16-bit brain
# floating point precision (`--precision bf16-true`)", "conducted on 1xA100 with a minibatch size
# of 128 using the `finetune/lora.py` script", "Llama 2: 1304 tokens" (the longest Alpaca training
# example). The lit-gpt script of that period has lora_r = 8, lora_query = True, lora_value = True
# (the others False) and puts the longest example first ("force the longest sample at the beginning
# so potential OOMs happen right away", Lightning-AI/litgpt:finetune/lora.py at 0010d8ef), padding
# each micro-batch to its longest row: the peak step holds S = 1304. 4,194,304 trainable = 32
# layers x 2 (q, v) x 8 x (4096 + 4096), rank 8 on query and value.
RT = "https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md (LoRA on 1 GPU)"
RT_SETUP = ("1xA100-SXM4-40GB, PyTorch 2.1.0, bnb 0.41.1, litgpt finetune/lora.py @8641822, "
            "--precision bf16-true, LoRA r=8 on query+value ({trainable} trainable), AdamW, "
            "minibatch 128, Alpaca (longest example 1304 tokens)")
RT_LORA = dict(dtype="bf16", lora_rank=8, lora_targets="q_proj,v_proj", batch=128, seq=1304)
# config_hub/finetune/README.md: "All experiments were conducted using bfloat-16 precision on the
# Alpaca2k dataset"; each YAML sets precision: bf16-true, lora_r: 32, lora_alpha: 16, lora_query
# and lora_value: true (key, projection, mlp, head: false), global_batch_size: 8,
# max_seq_length: 512; the peak step is taken at S = 512, the truncation length (this assumes
# Alpaca2k holds a row of at least 512 tokens).
HUB = "https://github.com/Lightning-AI/litgpt/blob/main/config_hub/finetune/README.md"
HUB_YAML = " + config_hub/finetune/{}.yaml"
HUB_SETUP = ("1xA10G, bf16-true, LoRA r=32 alpha=16 on query+value, torch AdamW, "
             "micro-batch {} of 8, max_seq_length 512, Alpaca2k")
HUB_LORA = dict(dtype="bf16", lora_rank=32, lora_targets="q_proj,v_proj", batch=8, seq=512)
ALLOC = Measure.ALLOCATED

ROWS: tuple[Published, ...] = (
    Published(
        "litgpt-rt-llama2-7b-lora-mb1", RT,
        RT_SETUP.format(trainable="4,194,304") + "; Llama 2 7B, no quantization, micro-batch 1",
        # "| 7 B   | Llama 2        | None         | 1               | 4,194,304            |
        #  21.30 GB    | 2.36 min           |"
        21.30, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama2-7b", micro_batch=1, **RT_LORA), LITGPT_OWN),
    Published(
        "litgpt-rt-llama2-7b-lora-mb2", RT,
        RT_SETUP.format(trainable="4,194,304") + "; Llama 2 7B, no quantization, micro-batch 2",
        # "| 7 B   | Llama 2        | None         | 2               | 4,194,304            |
        #  29.07 GB    | 2.52 min           |"
        29.07, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama2-7b", micro_batch=2, **RT_LORA),
        LITGPT_OWN + "; the second row's length (each micro-batch is padded to its longest row)"),
    Published(
        "litgpt-rt-llama2-7b-nf4-mb1", RT,
        RT_SETUP.format(trainable="4,194,304") + "; Llama 2 7B, quantization bnb.nf4, "
        "micro-batch 1",
        # "| 7 B   | Llama 2        | bnb.nf4      | 1               | 4,194,304            |
        #  14.14 GB    | 3.68 min           |"
        14.14, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama2-7b", micro_batch=1, quant="nf4", **RT_LORA), LITGPT_OWN + "; " + BNB,
        (Named.BNB_EVERY_LINEAR,)),
    Published(
        "litgpt-rt-llama2-13b-lora-mb1", RT,
        RT_SETUP.format(trainable="6,553,600") + "; Llama 2 13B, no quantization, micro-batch 1",
        # "| 13 B  | Llama 2        | None         | 1               | 6,553,600            |
        #  38.12 GB    | 3.19 min           |"
        38.12, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama2-13b", micro_batch=1, **RT_LORA), LITGPT_OWN),
    Published(
        "litgpt-rt-llama2-13b-nf4-mb1", RT,
        RT_SETUP.format(trainable="6,553,600") + "; Llama 2 13B, quantization bnb.nf4, "
        "micro-batch 1",
        # "| 13 B  | Llama 2        | bnb.nf4      | 1               | 6,553,600            |
        #  23.14 GB    | 6.38 min           |"
        23.14, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama2-13b", micro_batch=1, quant="nf4", **RT_LORA), LITGPT_OWN + "; " + BNB,
        (Named.BNB_EVERY_LINEAR,)),
    Published(
        "litgpt-rt-llama2-7b-lora-fsdp2", RT.replace("on 1 GPU", "on Multiple GPUs"),
        RT_SETUP.format(trainable="4,194,304").replace("1xA100", "2xA100")
        + "; FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, "
        "state_dict_type='full', limit_all_gathers=True); Llama 2 7B, no quantization, "
        "micro-batch 1",
        # "| 7 B   | Llama 2        | None         | 1               | 4,194,304            |
        #  2 x A100 | 22.18 GB    | 5.93 min           |"
        # The lit-gpt script of that period (finetune/lora.py at 0010d8ef): "devices = 2", and with
        # devices > 1: precision="bf16-true", strategy=FSDPStrategy(auto_wrap_policy={Block},
        # activation_checkpointing_policy={Block}, state_dict_type="full", limit_all_gathers=True).
        22.18, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama2-7b", micro_batch=1, dp=2, zero=3, checkpoint="full", **RT_LORA),
        LITGPT_OWN + "; FSDP's flat parameters and the model's load (`fabric.init_module("
        "empty_init=False)` then `load_raw` of the whole checkpoint)"),
    Published(
        "litgpt-hub-llama2-7b-lora", HUB + HUB_YAML.format("llama-2-7b/lora"),
        HUB_SETUP.format(2) + "; Llama 2 7B",
        # "| llama-2-7b/lora.yaml              | llama-2-7b             | 4      | 512            |
        #  2                | 1xA10G  | 32.82 min        | $1.0 | 19.77 GB    |"
        19.77, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama2-7b", micro_batch=2, **HUB_LORA), LITGPT_OWN),
    Published(
        "litgpt-hub-llama2-7b-qlora", HUB + HUB_YAML.format("llama-2-7b/qlora"),
        HUB_SETUP.format(2) + ", quantize bnb.nf4; Llama 2 7B",
        # "| llama-2-7b/qlora.yaml             | llama-2-7b             | 4      | 512            |
        #  2                | 1xA10G  | 45.67 min        | $1.4 | 13.68 GB    |"
        13.68, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama2-7b", micro_batch=2, quant="nf4", **HUB_LORA), LITGPT_OWN + "; " + BNB,
        (Named.BNB_EVERY_LINEAR,)),
    Published(
        "litgpt-hub-llama3-8b-lora", HUB + HUB_YAML.format("llama-3-8b/lora"),
        HUB_SETUP.format(1) + "; Llama 3 8B",
        # "| llama-3-8b/lora.yaml              | llama-3-8b             | 2      | 512            |
        #  1                | 1xA10G  | 14.79 min        | $0.4 | 19.73 GB    |"
        19.73, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama3-8b", micro_batch=1, **HUB_LORA), LITGPT_OWN),
    Published(
        "litgpt-hub-llama3-8b-qlora", HUB + HUB_YAML.format("llama-3-8b/qlora"),
        HUB_SETUP.format(2) + ", quantize bnb.nf4; Llama 3 8B",
        # "| llama-3-8b/qlora.yaml             | llama-3-8b             | 2      | 512            |
        #  2                | 1xA10G  | 22.24 min        | $0.7 | 17.41 GB    |"
        17.41, "GB", ALLOC, LITGPT_MEASURE,
        dict(model="llama3-8b", micro_batch=2, quant="nf4", **HUB_LORA), LITGPT_OWN + "; " + BNB,
        (Named.BNB_EVERY_LINEAR,)),
    Published(
        "transformers-anatomy-bert-large",
        "https://huggingface.co/docs/transformers/model_memory_anatomy "
        "(huggingface/transformers: docs/source/en/model_memory_anatomy.md)",
        "1x Tesla V100 16 GB, google-bert/bert-large-uncased sequence classifier, Trainer with "
        "per_device_train_batch_size=4, 512 tokens per row, fp32, the Trainer's default AdamW, "
        "no checkpointing",
        # "Time: 57.82\nSamples/second: 8.86\nGPU memory occupied: 14949 MB."
        14949, "MiB", Measure.NVIDIA_SMI,
        "print_gpu_utilization prints NVML's `info.used//1024**2` as 'MB', i.e. MiB (the doc's "
        "nvidia-smi output shows its 2631 MB figure as 2631MiB)",
        None,
        "bert-large-uncased: labkit models the GPT-2 and Llama families only; NVML's used memory "
        "also holds the CUDA context and kernels (the doc measures 1343 MB of it before the model "
        "loads) and the caching allocator's reserve"),
)


def recipe_of(row: Published):
    """The labkit Recipe of a modelled row (device="cuda"); None for a row labkit does not model."""
    from labkit.estimate import Recipe

    return None if row.recipe is None else Recipe(device="cuda", **row.recipe)


def bnb_every_linear_bytes(recipe) -> int:
    """Bytes labkit keeps in bf16 that Lightning's bnb.nf4 holds in NF4: every Linear outside
    labkit's quantized set (Recipe.quant_set; the default, transformers + bitsandbytes', leaves
    the head out, which Lightning replaces too), 2 bytes per weight in labkit and
    `nf4_bytes_for(n, double_quant=False)` (4-bit codes, an fp32 absmax per 64 weights) there."""
    from labkit.estimate import peft_terms, spec_from
    from labkit.quant.nf4 import nf4_bytes_for

    spec = spec_from(recipe.model, **recipe.config)
    quantized = {name for name, *_ in peft_terms.of_recipe(spec, recipe).quantized}
    out = 0
    for name, d_in, d_out, _ in spec.linears:
        if name not in quantized:
            n = d_in * d_out
            out += 2 * n - nf4_bytes_for(n, double_quant=False)
    return out


NAMED_BYTES = {Named.BNB_EVERY_LINEAR: bnb_every_linear_bytes}


def run_row(row: Published) -> dict:
    """labkit's figures for one row, in the row's unit: pred, diff, pct, named, left, left_pct."""
    out = {"row": row, "recipe": recipe_of(row)}
    if out["recipe"] is None:
        return out
    from labkit.estimate import estimate

    unit = UNITS[row.unit]
    try:
        pred = estimate(out["recipe"]).peak.total / unit
    except ValueError as e:  # a combination labkit refuses, with its reason
        out["refused"] = str(e)
        return out
    named = sum(NAMED_BYTES[n](out["recipe"]) for n in row.named) / unit
    diff = pred - row.figure
    out.update(pred=pred, diff=diff, pct=100 * diff / row.figure,
               named=named if row.named else None, left=diff - named,
               left_pct=100 * (diff - named) / row.figure)
    return out


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def describe_recipe(recipe) -> str:
    if recipe is None:
        return "none (not modelled)"
    keys = ("model", "batch", "micro_batch", "seq", "dtype", "optimizer", "checkpoint",
            "lora_rank", "lora_targets", "quant", "dp", "zero", "device")
    return " ".join(f"{k}={getattr(recipe, k)}" for k in keys
                    if getattr(recipe, k) not in (None, "none", 0)
                    and not (k == "dp" and recipe.dp == 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", metavar="KEY", help="one row, by its key")
    args = ap.parse_args(argv)
    rows = [r for r in ROWS if args.only in (None, r.key)]
    if not rows:
        ap.error(f"no row {args.only!r}; keys: {', '.join(r.key for r in ROWS)}")
    results = []
    for row in rows:
        print(f"estimating {row.key} ...", file=sys.stderr)
        results.append(run_row(row))

    print("published peak vs labkit's CUDA estimate, in the published unit")
    print("(diff: labkit - published; named: a derived allocation; left: diff - named)")
    table = [["key", "published", "measures", "labkit", "diff", "diff %", "named", "left %"]]
    for r in results:
        row = r["row"]
        fig = f"{row.figure:,.2f} {row.unit}"
        short = row.measures.name.lower()
        if r["recipe"] is None or "refused" in r:
            what = "not modelled" if r["recipe"] is None else "refused"
            table.append([row.key, fig, short, what, "", "", "", ""])
            continue
        named = "" if r["named"] is None else f"{r['named']:+.2f}"
        left = "" if r["named"] is None else f"{r['left_pct']:+.1f}"
        table.append([row.key, fig, short, f"{r['pred']:.2f} {row.unit}", f"{r['diff']:+.2f}",
                      f"{r['pct']:+.1f}", named, left])
    print(_table(table))

    wrap = textwrap.TextWrapper(width=118, initial_indent="    ", subsequent_indent="      ",
                                break_on_hyphens=False)
    for r in results:
        row = r["row"]
        print(f"\n{row.key}")
        for label, text in (("source", row.source), ("setup", row.setup),
                            ("measures", f"{row.measures.value}, {row.unit}: {row.how_known}"),
                            ("recipe", describe_recipe(r["recipe"])
                             + (f" -> refused: {r['refused']}" if "refused" in r else "")),
                            ("named", "; ".join(n.value for n in row.named) or "-"),
                            ("not modelled", row.not_modelled)):
            print(wrap.fill(f"{label}: {text}"))

    modelled = [r for r in results if "pred" in r]
    refused = sum("refused" in r for r in results)
    summary = f"published_runs: rows={len(results)} modelled={len(modelled)} refused={refused}"
    if modelled:
        diffs = [abs(r["pct"]) for r in modelled]
        lefts = [abs(r["left_pct"]) for r in modelled]
        summary += (f" median_abs_diff={statistics.median(diffs):.1f}%"
                    f" max_abs_diff={max(diffs):.1f}%"
                    f" median_abs_left={statistics.median(lefts):.1f}%")
    print("\n" + summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
