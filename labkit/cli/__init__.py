"""Command line: `python -m labkit estimate` prints one step's predicted memory, `wall` which models fit which GPUs
(for full fine-tuning, LoRA and QLoRA), `plan` which configuration to train with (labkit.plan).

The commands share labkit.cli.common (usage errors, input bounds, reading a model); each has a module of its
own: labkit.cli.estimate, labkit.cli.wall, labkit.cli.plan. This module builds the parser and runs it."""

from __future__ import annotations

import re
import sys

from labkit.estimate.predict import DTYPES, OPTIMIZERS
from labkit.estimate.recipe import PROJ_DTYPES, SELECTIVE_POLICIES
from labkit.estimate.peft_terms import QUANTS
from labkit.estimate.recipe import QUANT_SETS
from labkit.estimate.moments import POLICIES
from labkit.memory.units import HEADROOM

from .configs import cmd_compare, cmd_estimate_all
from .common import (ADDRESS_SPACE, INT_LIMIT, MAX_LAYERS, MAX_SIZE, MAX_WALL_LAYERS, UNITS_NOTE, UsageError, _Parser,
                     check_model, integer, parse_gpt_spec, read_model, resolve_model)
from .estimate import check_estimate_options, cmd_estimate, estimate_dict, format_estimate
from .plan import PLAN_PRECISIONS, cmd_plan, format_plans
from .wall import WALL_RECIPE, WALL_SOURCE, cmd_wall, format_wall

__all__ = ["ADDRESS_SPACE", "INT_LIMIT", "MAX_LAYERS", "MAX_SIZE", "MAX_WALL_LAYERS", "PLAN_PRECISIONS", "UNITS_NOTE",
           "UsageError", "build_parser", "check_estimate_options", "check_model", "cmd_estimate", "cmd_plan",
           "cmd_wall", "estimate_dict", "format_estimate", "format_plans", "format_wall", "integer", "main",
           "parse_gpt_spec", "read_model", "resolve_model"]


# ----------------------------------------------------------------------------- entry point
def build_parser() -> _Parser:
    parser = _Parser(prog="labkit", description="Predict the memory of training a model.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p, device_default, dtype_default, device_help):
        p.add_argument("--batch", type=integer, default=1, help="sequences per step (B)")
        p.add_argument("--seq", type=integer, default=1024, help="tokens per sequence (S)")
        p.add_argument("--dtype", choices=DTYPES, default=dtype_default,
                       help="how weights and compute are stored (default mixed-bf16)")
        p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
        p.add_argument("--device", choices=("cpu", "cuda"), default=device_default, help=device_help)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")

    e = sub.add_parser("estimate", help="predicted bytes of one training step, by term, category and phase",
                       description=f"Predict one training step's memory, with CPU kernels unless --device cuda. "
                                   f"{UNITS_NOTE}.")
    e.add_argument("--model", default=None, metavar="NAME_OR_CONFIG",
                   help="a preset, a local transformers config, a hub id (online), or gpt:KEY=VAL,... "
                        "for labkit's GPT, e.g. gpt:n_layer=4,n_embd=256,block_size=512; at most "
                        f"{MAX_LAYERS} layers, sizes up to 2**24 (with --from: the model of a config that "
                        "names none)")
    from_options(e)
    e.add_argument("--waterfall", action="store_true",
                   help="what each knob buys: from the naive step (fp32, AdamW, no recompute, the whole batch, "
                        "one device) to the recipe, one knob at a time (savings depend on the order)")
    e.add_argument("--plot", default=None, metavar="PNG", help="with --waterfall: draw it into this PNG file")
    e.add_argument("--all-terms", action="store_true",
                   help="also list every term of the whole step, each at its largest (a summary "
                        "across phases whose sum is not the peak); the default lists the terms "
                        "alive at the peak")
    e.add_argument("--verify", action="store_true",
                   help="with --waterfall: also measure each bar under the ledger (small models, one device)")
    common(e, "cpu", "mixed-bf16", "whose kernels to model (default cpu on every machine, with or without a GPU: "
           "CPU kernels; give --device cuda for a GPU's, whose fused attention, dropout masks and Adam's foreach "
           "path differ, so a GPU-sized model's peak differs)")
    e.add_argument("--checkpoint", choices=POLICIES, default="none",
                   help="activation checkpointing of the blocks (labkit GPT, transformers GPT-2 and Llama; "
                        "labkit.recompute)")
    e.add_argument("--segments", type=integer, default=None, help="segments for --checkpoint full (default: every block)")
    e.add_argument("--selective-policy", choices=SELECTIVE_POLICIES, default=None,
                   help="which ops --checkpoint selective saves: matmuls (default: every matmul's output kept, the "
                        "rest recomputed) or attention-core (Korthikanti et al. 2022: the attention core, QK^T, "
                        "softmax and dropout, is recomputed; the linear outputs, norms and MLP activation are "
                        "kept; labkit.recompute.selective)")
    e.add_argument("--offload-activations", action="store_true", help="keep saved activations in host memory")
    e.add_argument("--micro-batch", type=integer, default=None, help="rows per micro-batch (gradient accumulation)")
    e.add_argument("--accumulate", type=integer, default=None, help="micro-batches per step (batch / micro-batch)")
    e.add_argument("--micro-batches", type=integer, default=None,
                   help="micro-batches per step on each rank (M; the pipeline's m): --micro-batch = batch / dp / M")
    e.add_argument("--tp", type=integer, default=1, help="tensor-parallel ranks (labkit's GPT; Megatron-LM split)")
    e.add_argument("--pp", type=integer, default=1, help="pipeline stages (consecutive blocks per stage)")
    e.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="pipeline schedule (--pp > 1)")
    e.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp > 1: norms and dropouts split along the sequence (Korthikanti et al. 2022)")
    e.add_argument("--rank", type=integer, default=None, help="GaLore's rank (--optimizer galore or galore8bit)")
    e.add_argument("--proj-dtype", choices=PROJ_DTYPES, default=None,
                   help="8-bit GaLore's projector: param (the weights' dtype, the default), fp32 or int8 "
                        "(--optimizer galore8bit)")
    e.add_argument("--optimizer-offload", choices=("cpu", "disk"), default=None,
                   help="AdamW state and step in host memory or on disk (labkit.optim.OffloadAdamW)")
    e.add_argument("--step-in-backward", action="store_true", help="step each parameter as its gradient is ready")
    e.add_argument("--paged", action="store_true",
                   help="the optimizer's states in CUDA unified memory, as bitsandbytes' "
                        "PagedAdamW / PagedAdamW8bit keep them (--optimizer adamw, adamw8bit, "
                        "adam, adam8bit or lion): outside the peak (max_memory_allocated), "
                        "printed apart; with --budget, what the driver pages out")
    e.add_argument("--lora-rank", type=integer, default=None, help="LoRA adapters of this rank; every base weight frozen")
    e.add_argument("--lora-targets", default=None,
                   help="comma-separated Linear module names or endings (e.g. q_proj,v_proj), "
                        "or all-linear (every Linear but lm_head; the default); needs --lora-rank")
    e.add_argument("--quant", choices=QUANTS, default="none",
                   help="store the frozen base under the adapters in int8, NF4 (nf4 = QLoRA), or group-wise int4: "
                        "round-to-nearest (int4) or AWQ (int4-awq, its input scale kept per layer); needs --lora-rank")
    e.add_argument("--quant-group", type=integer, default=None,
                   help="int4's group size along the input features (default 128; must divide every target's "
                        "input features); needs --quant int4 or int4-awq")
    e.add_argument("--quant-set", choices=QUANT_SETS, default=None,
                   help="which Linears --quant stores: all-linear (every Linear but the head, "
                        "whatever --lora-targets: transformers + bitsandbytes' load_in_4bit, the "
                        "default) or targets (the adapted ones only: torchtune's qlora builders); "
                        "needs --quant")
    e.add_argument("--base-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="the frozen base's precision under LoRA/QLoRA: bf16 or fp16 with --dtype mixed-bf16 / "
                        "mixed-fp16 is peft's usual setup (16-bit base, fp32 adapters under autocast); "
                        "default: --dtype's weights; needs --lora-rank")
    e.add_argument("--loss-chunks", type=integer, default=None, metavar="N",
                   help="the output head and its cross-entropy in N chunks along the sequence, "
                        "each chunk's logits upcast to fp32 alone (torchtune's "
                        "CEWithChunkedOutputLoss, 8 in its recipes; default: the whole logits, "
                        "transformers' loss)")
    e.add_argument("--lisa-layers", type=integer, default=None,
                   help="LISA: train embeddings, head and this many sampled layers at a time")
    e.add_argument("--dp", type=integer, default=1,
                   help="data-parallel ranks: --batch is the global batch, each rank takes batch / dp rows; per-rank bytes")
    e.add_argument("--zero", type=integer, default=0, help="ZeRO stage over the dp ranks: 0 (plain), 1 (optimizer "
                   "state sharded), 2 (+ gradients), 3 (+ parameters)")
    e.add_argument("--zero-offload", action="store_true", help="ZeRO-Offload: the optimizer state shards in host memory")
    fit_options(e, "--budget", "a device's memory, with its unit (24GB = 24 x 10**9 bytes, 24GiB = 24 x 2**30): "
                "say whether the step fits, is tight or does not fit, by plan's rule")
    e.set_defaults(run=cmd_estimate_all, parser=e, seq=None, device=None)
    w = sub.add_parser("wall", help="which presets fit which GPU budgets for full fine-tuning, LoRA and QLoRA",
                       description=f"Which models fit which budgets, by default under the QLoRA paper's recipe "
                                   f"({WALL_SOURCE}). {UNITS_NOTE}.")
    w.add_argument("--models", default=None, help="comma-separated, each as --model of estimate, "
                   f"{MAX_WALL_LAYERS} layers in all (default: every non-tiny preset)")
    w.add_argument("--budgets", default="16GiB,24GiB,48GiB,80GiB",
                   help="comma-separated sizes, each with its unit: 24GB (10**9 bytes) or 24GiB (2**30 bytes)")
    w.add_argument("--methods", default="full,lora,qlora",
                   help="comma-separated: full (fine-tuning), lora, qlora (LoRA on an NF4 base)")
    w.add_argument("--lora-rank", type=integer, default=None,
                   help="LoRA rank for the lora and qlora methods (default 64, QLoRA's)")
    w.add_argument("--lora-targets", default=None,
                   help="the lora and qlora methods' targets: comma-separated Linear names or "
                        "endings (e.g. q_proj,v_proj), or all-linear (every Linear but the head; "
                        "the default)")
    w.add_argument("--quant-set", choices=QUANT_SETS, default=None,
                   help="which Linears the qlora method stores in NF4: all-linear (every Linear "
                        "but the head: transformers + bitsandbytes, the default) or targets "
                        "(torchtune's)")
    w.add_argument("--adapters", choices=("base", "fp32"), default="base",
                   help="LoRA/QLoRA adapters in the bf16 base's dtype (base: the QLoRA paper's scripts, the "
                        "default) or in fp32 under autocast (fp32: peft's default, Recipe.base_dtype)")
    common(w, "cuda", None, "whose kernels to model (default cuda: a GPU's fused attention, dropout masks and "
           "Adam's foreach path; cpu for CPU kernels)")
    w.add_argument("--checkpoint", choices=POLICIES, default="full",
                   help="activation checkpointing of the blocks (default full: QLoRA's gradient checkpointing)")
    w.add_argument("--micro-batch", type=integer, default=None,
                   help="rows per micro-batch (default 4, QLoRA's, when it divides --batch; else the whole batch)")
    w.add_argument("--loss-chunks", type=integer, default=None, metavar="N",
                   help="every row's output head and loss in N chunks along the sequence, each "
                        "upcast to fp32 alone (torchtune's CEWithChunkedOutputLoss; default: the "
                        "whole logits)")
    w.add_argument("--headroom", type=float, default=HEADROOM * 100, metavar="PERCENT",
                   help=f"mark a fit tight when its peak is within this share of the budget (default "
                        f"{HEADROOM * 100:.0f} %%, as plan)")
    from_options(w)
    w.set_defaults(batch=WALL_RECIPE["batch"], seq=WALL_RECIPE["seq"])
    w.set_defaults(run=cmd_wall, parser=w)
    p = sub.add_parser("plan", help="which training configuration fits a model on some devices, ranked",
                       description=f"Search configurations that fit, ranked by fidelity then predicted time. {UNITS_NOTE}.")
    p.add_argument("--model", default=None, metavar="NAME_OR_CONFIG", help="as --model of estimate")
    from_options(p)
    p.add_argument("--devices", type=integer, default=1, help="devices (GPUs) to use (default 1)")
    p.add_argument("--memory", default=None,
                   help="memory per device: 24GiB = 24 x 2**30 bytes, 24GB = 24 x 10**9 bytes (default: the preset's)")
    p.add_argument("--headroom", type=float, default=HEADROOM * 100, metavar="PERCENT",
                   help="flag plans whose peak is within this share of --memory (default 10: the allocator's cache "
                        "and the CUDA context are not in the predicted bytes)")
    p.add_argument("--device-preset", default=None,
                   help="t4, a10, a100-40gb, a100-80gb, h100, h200 or cpu: the speeds times assume "
                        "(default: the preset closest to --memory)")
    p.add_argument("--tokens", default=None, metavar="B*S", help="rows x tokens per row per step, e.g. 8*1024")
    p.add_argument("--batch", type=integer, default=None, help="rows per step, the global batch (default 1)")
    p.add_argument("--seq", type=integer, default=None, help="tokens per row (default min(1024, the model's))")
    p.add_argument("--peft", action="store_true", help="also consider LISA, LoRA and QLoRA")
    p.add_argument("--min-precision", choices=PLAN_PRECISIONS, default="bf16",
                   help="the least precise dtype allowed (default bf16)")
    p.add_argument("--optimizers", default=None,
                   help="comma-separated: adamw, adamw8bit, adafactor, lion, galore, galore8bit (default all)")
    p.add_argument("--top", type=integer, default=5, help="plans to show (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--verify", action="store_true",
                   help="run the best plan for real under the ledger (small models only) and compare peaks")
    p.add_argument("--export", default=None, metavar="DIR", help="write the best plan's launch files to DIR")
    p.set_defaults(run=cmd_plan, parser=p)
    c = sub.add_parser("compare", help="what the published memory calculators say, beside labkit's figures",
                       description="accelerate's estimate-memory, ZeRO's Figure 1 and DeepSpeed's zero2/zero3 "
                                   "estimators, each with its own conventions, beside labkit's textbook and exact "
                                   f"figures, with one line per difference. {UNITS_NOTE}.")
    c.add_argument("--model", required=True, metavar="NAME", help="a labkit preset (the calculators read a model "
                                                                     "by name)")
    common(c, "cpu", "mixed-bf16", "whose kernels labkit models (default cpu; cuda for a GPU's)")
    c.add_argument("--dp", type=integer, default=1, help="devices: ZeRO's N_d and DeepSpeed's GPUs (default 1)")
    c.set_defaults(run=cmd_compare, parser=c, seq=512)
    return parser


def from_options(p) -> None:
    p.add_argument("--from", dest="from_path", default=None, metavar="PATH",
                   help="a training config: a torchtune or axolotl YAML, a TrainingArguments or DeepSpeed JSON, "
                        "an accelerate config, or a folder `plan --export` wrote (labkit.plan.configs); every "
                        "knob comes from it, and what it leaves open (--seq, --dp for the devices) from here")
    p.add_argument("--target", default=None, choices=("training_args", "accelerate", "torchrun", "deepspeed"),
                   help="with --from an export folder: whose files to read (default: the first that carries "
                        "every field)")


def fit_options(p, name: str, help: str) -> None:
    p.add_argument(name, default=None, metavar="SIZE", help=help)
    p.add_argument("--headroom", type=float, default=HEADROOM * 100, metavar="PERCENT",
                   help=f"call a fit tight when its peak is within this share of {name} (default "
                        f"{HEADROOM * 100:.0f} %%, as plan: the allocator's cache and the CUDA context are not in "
                        "the predicted bytes)")


SIZE_OPTIONS = ("--memory", "--budget", "--budgets")
_NEGATIVE = re.compile(r"-[0-9.]")


def _join_negative_sizes(argv: list[str]) -> list[str]:
    """`--memory -24GB`: argparse reads "-24GB" as an option and says "expected one argument"; join it to
    its option (--memory=-24GB) so that the size check says what is wrong with it."""
    out = []
    for a in argv:
        if out and out[-1] in SIZE_OPTIONS and _NEGATIVE.match(a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def main(argv=None) -> int:
    """Run the command line; returns the exit status (2 with one line on stderr for bad input)."""
    parser = build_parser()
    argv = _join_negative_sizes(list(sys.argv[1:] if argv is None else argv))
    prog = "labkit"
    try:
        args = parser.parse_args(argv)
        prog = f"labkit {args.command}"
        return args.run(args, args.parser)
    except UsageError as err:
        print(" ".join(str(err).split()), file=sys.stderr)
    except (ValueError, TypeError, OSError) as err:  # the library's word on bad input, as one line
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
    return 2
