"""What int8 and NF4 do to MiniLM's weights next to bitsandbytes, and (with labkit.peft) what LoRA, QLoRA and LISA cost.

    python bench/weights.py [--quick] [--no-peft] [--threads N]

Part 1: every nn.Linear weight of the pretrained all-MiniLM-L6-v2 is quantized to int8 (absmax, one
scale per row), NF4 (blocks of 64) and NF4 with double quantization, by labkit.quant and by
bitsandbytes (int8_vectorwise_quant, quantize_4bit nf4): relative RMSE over all weights together,
bits per parameter (codes and statistics actually held; shared lookup tables not counted), the
share of identical 4-bit codes, and our figures as ratios to bitsandbytes'.
Part 2, only when labkit.peft (with its tasks module) is importable: labkit.peft.tasks.adapt_task
(a GPT pretrained on the comedies, adapted to the histories; --quick: its smoke sizes) for full
fine-tuning, LoRA, QLoRA and LISA, and the libraries' equivalents in the same run (same seeds,
batches, adapter init and measured steps): peft's LoRA ("peft-lora"), bitsandbytes Linear4bit NF4 +
peft's LoRA ("bnb-qlora") and LISANaive, the reference callback that never frees a frozen layer's
optimizer state ("lisa-naive"): trainable parameters, peak memory (Ledger), median seconds per step
(outside the Ledger) and validation loss after, each as a ratio to full fine-tuning and to the
equivalent; and classify_task accuracy (MiniLM, First Folio or modern spelling) for full, LoRA,
QLoRA, peft-lora and bnb-qlora, with the same ratios. The last line is the summary:
`weights: int8_bits=.. nf4_bits=.. nf4_dq_bits=.. int8_err_vs_bnb=.. nf4_err_vs_bnb=.. nf4_dq_err_vs_bnb=..
[lora_mem=.. ... lora_mem_vs_peft=.. qlora_mem_vs_bnb=.. lisa_mem_vs_naive=.. ...]`
"""

from __future__ import annotations

import argparse
import importlib.util
import math

import torch
import torch.nn as nn


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def weight_figures(model) -> dict[str, dict[str, float]]:
    """{format: {"err": relative RMSE over all linear weights, "bits": bits per parameter, ...}} for ours and bnb's."""
    import bitsandbytes.functional as bnbF

    from labkit.quant import bits_per_param_nf4, dequantize_int8, dequantize_nf4, nbytes_nf4, quantize_int8, quantize_nf4

    weights = [m.weight.detach().float() for m in model.modules() if type(m) is nn.Linear]
    n = sum(w.numel() for w in weights)
    sse, nbytes, same = {}, {}, {}
    sq = sum(w.double().pow(2).sum().item() for w in weights)

    def add(key, w, w_hat, b):
        sse[key] = sse.get(key, 0.0) + (w_hat.double() - w.double()).pow(2).sum().item()
        nbytes[key] = nbytes.get(key, 0) + b

    for w in weights:
        q = quantize_int8(w, "absmax", "channel")
        add("int8", w, dequantize_int8(q), q.nbytes)
        codes, stats, _ = bnbF.int8_vectorwise_quant(w)
        add("int8 bnb", w, codes.float() * stats[:, None] / 127, _nbytes(codes, stats))
        for dq, key in ((False, "nf4"), (True, "nf4_dq")):
            packed, state = quantize_nf4(w, 64, double_quant=dq)
            add(key, w, dequantize_nf4(packed, state), nbytes_nf4(packed, state))
            qb, sb = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=dq)
            extra = _nbytes(sb.state2.absmax, sb.offset) if dq else 0  # the 256-entry dynamic map not counted
            add(key + " bnb", w, bnbF.dequantize_4bit(qb, sb), _nbytes(qb, sb.absmax) + extra)
            hits, tot = same.get(key, (0, 0))
            same[key] = (hits + int((qb.view(-1) == packed).sum()), tot + packed.numel())
    out = {k: {"err": math.sqrt(sse[k] / sq), "bits": 8 * nbytes[k] / n} for k in sse}
    for key, (hits, tot) in same.items():
        out[key]["codes_equal"] = hits / tot
    out["_n"] = {"params": n, "layers": len(weights)}
    return out


REF = {"lora": ("peft-lora", "peft"), "qlora": ("bnb-qlora", "bnb"), "lisa": ("lisa-naive", "naive")}
REF_OF = {ref: mine for mine, (ref, _) in REF.items()}


def peft_figures(quick: bool) -> dict:
    from labkit.peft.tasks import adapt_task, classify_task

    adapt = adapt_task(methods=("full", "lora", "peft-lora", "qlora", "bnb-qlora", "lisa", "lisa-naive"),
                       smoke_mode=quick, device="cpu")
    spelling = classify_task(methods=("full", "lora", "peft-lora", "qlora", "bnb-qlora"), smoke_mode=quick, device="cpu")
    return {"adapt": adapt, "spelling": spelling}


def _pair(results, m):
    """(labkit's method, its library equivalent) for a row: a reference row is paired with ours, and vice versa."""
    if m in REF and REF[m][0] in results:
        return results[REF[m][0]]
    if m in REF_OF and REF_OF[m] in results:
        return results[REF_OF[m]]
    return None


def _ratios(r, other) -> str:
    """trainable / peak / s per step / metric after, as ratios of r to other ('-' if there is no other)."""
    if other is None:
        return f"{'-':>29}"
    return (f"{r.trainable / other.trainable:6.3f} {r.peak.total / other.peak.total:6.3f} "
            f"{r.step_seconds / other.step_seconds:6.3f} {r.after / other.after:7.3f}")


def print_table(title: str, results: dict, metric: str) -> None:
    full = results["full"]
    print(f"\n{title}")
    print(f"{'method':10} {'trainable':>10} {'peak MiB':>9} {'opt MiB':>8} {'ms/step':>8} {metric + ' before->after':>22}   "
          f"{'ratio to full: params/mem/time/' + metric:>36}   ratio to the library equivalent (same order)")
    for m, r in results.items():
        if m == "probe":
            print(f"{m:10} {r.trainable:10,} {'-':>9} {'-':>8} {'-':>8} {r.before:10.3f} -> {r.after:7.3f}")
            continue
        print(f"{m:10} {r.trainable:10,} {r.peak.total / 2**20:9.2f} {r.opt_peak / 2**20:8.2f} {r.step_seconds * 1e3:8.1f} "
              f"{r.before:10.3f} -> {r.after:7.3f}   {_ratios(r, full):>36}   {_ratios(r, _pair(results, m))}")
    hidden = max((r.hidden_bytes for r in results.values()), default=0)
    if hidden:
        print(f"  bnb-qlora: the Ledger counts bitsandbytes' custom ops by their outputs; the weight gemm_4bit "
              f"dequantizes inside its CPU kernel (at most {hidden / 2**20:.2f} MiB at a time) is not in its peak")
    measured = sorted({(r.measured_steps, m) for m, r in results.items() if m != "probe"})
    print("  peak: over the first steps under the Ledger (" + ", ".join(f"{m} {n}" for n, m in measured) +
          "); opt: the most optimizer state at a phase peak; ms/step: median of the steps after them")


def summarize(summary: dict, adapt: dict, spelling: dict) -> None:
    full = adapt["full"]
    for m in ("lora", "qlora", "lisa"):
        r = adapt[m]
        summary[f"{m}_mem"] = f"{r.peak.total / full.peak.total:.3f}"
        summary[f"{m}_params"] = f"{r.trainable / full.trainable:.4f}"
        summary[f"{m}_time"] = f"{r.step_seconds / full.step_seconds:.3f}"
        summary[f"{m}_loss"] = f"{r.after / full.after:.3f}"
    for m in ("lora", "qlora"):
        summary[f"{m}_acc"] = f"{spelling[m].after / spelling['full'].after:.3f}"
    for m, (ref, short) in REF.items():
        r, q = adapt[m], adapt[ref]
        summary[f"{m}_mem_vs_{short}"] = f"{r.peak.total / q.peak.total:.3f}"
        if m == "lisa":
            summary["lisa_opt_vs_naive"] = f"{r.opt_peak / max(q.opt_peak, 1):.3f}"
        summary[f"{m}_time_vs_{short}"] = f"{r.step_seconds / q.step_seconds:.3f}"
        summary[f"{m}_loss_vs_{short}"] = f"{r.after / q.after:.3f}"
        if m in spelling and ref in spelling:
            summary[f"{m}_acc_vs_{short}"] = f"{spelling[m].after / spelling[ref].after:.3f}"
            summary[f"{m}_cls_mem_vs_{short}"] = f"{spelling[m].peak.total / spelling[ref].peak.total:.3f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke-sized PEFT tasks (seconds, not minutes)")
    ap.add_argument("--no-peft", action="store_true", help="only the weight figures")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: a shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from labkit.models.minilm import load_minilm

    model, _ = load_minilm()
    f = weight_figures(model)
    print(f"MiniLM: {f['_n']['layers']} linear weights, {f['_n']['params']:,} parameters")
    print(f"{'format':10} {'bits/param':>11} {'bnb bits':>9} {'ratio':>7} {'rel RMSE':>10} {'bnb RMSE':>10} {'ratio':>7} {'codes =':>8}")
    summary = {}
    for key in ("int8", "nf4", "nf4_dq"):
        a, b = f[key], f[key + " bnb"]
        eq = f"{a['codes_equal']:.4%}" if "codes_equal" in a else "-"
        print(f"{key:10} {a['bits']:11.4f} {b['bits']:9.4f} {a['bits'] / b['bits']:7.4f} {a['err']:10.6f} "
              f"{b['err']:10.6f} {a['err'] / b['err']:7.4f} {eq:>8}")
        summary[f"{key}_bits"] = f"{a['bits']:.4f}"
    for key in ("int8", "nf4", "nf4_dq"):
        summary[f"{key}_err_vs_bnb"] = f"{f[key]['err'] / f[key + ' bnb']['err']:.4f}"
    for key in ("int8", "nf4", "nf4_dq"):
        summary[f"{key}_bits_vs_bnb"] = f"{f[key]['bits'] / f[key + ' bnb']['bits']:.4f}"

    has_peft = importlib.util.find_spec("labkit.peft") is not None and importlib.util.find_spec("labkit.peft.tasks") is not None
    if has_peft and not args.no_peft:
        p = peft_figures(args.quick)
        quick = " [quick]" if args.quick else ""
        print_table("adapt_task (GPT, comedies -> histories)" + quick, p["adapt"], "val loss")
        print_table("classify_task (MiniLM, First Folio or modern spelling)" + quick, p["spelling"], "accuracy")
        summarize(summary, p["adapt"], p["spelling"])
    print("weights: " + " ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
