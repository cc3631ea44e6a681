"""What int8 and NF4 do to MiniLM's weights next to bitsandbytes, and (with labkit.peft) what LoRA, QLoRA and LISA cost.

    python bench/weights.py [--quick] [--no-peft] [--threads N]

Part 1: every nn.Linear weight of the pretrained all-MiniLM-L6-v2 is quantized to int8 (absmax, one
scale per row), NF4 (blocks of 64) and NF4 with double quantization, by labkit.quant and by
bitsandbytes (int8_vectorwise_quant, quantize_4bit nf4): relative RMSE over all weights together,
bits per parameter (codes and statistics actually held; shared lookup tables not counted), the
share of identical 4-bit codes, and our figures as ratios to bitsandbytes'.
Part 2, only when labkit.peft (with its tasks module) is importable: labkit.peft.tasks.adapt_task
(a GPT pretrained on the comedies, adapted to the histories; --quick: its smoke sizes) for full
fine-tuning, LoRA, QLoRA and LISA: trainable parameters, peak memory (Ledger), seconds per step and
validation loss after, as ratios to full fine-tuning; and classify_task accuracy (MiniLM, First Folio or modern spelling) for full,
LoRA and QLoRA. The last line is the summary:
`weights: int8_bits=.. nf4_bits=.. nf4_dq_bits=.. int8_err_vs_bnb=.. nf4_err_vs_bnb=.. nf4_dq_err_vs_bnb=.. [lora_mem=.. ...]`
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


def peft_figures(quick: bool) -> dict:
    from labkit.peft.tasks import adapt_task, classify_task

    adapt = adapt_task(methods=("full", "lora", "qlora", "lisa"), smoke_mode=quick, device="cpu")
    genre = classify_task(methods=("full", "lora", "qlora"), smoke_mode=quick, device="cpu")
    return {"adapt": adapt, "genre": genre}


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
        adapt, genre = p["adapt"], p["genre"]
        full = adapt["full"]
        print("\nadapt_task (GPT, comedies -> histories)" + (" [quick]" if args.quick else ""))
        print(f"{'method':7} {'trainable':>11} {'ratio':>7} {'peak MiB':>9} {'ratio':>7} {'s/step*':>8} {'ratio':>7} "
              f"{'val loss':>15} {'ratio':>7}")
        for m, r in adapt.items():
            print(f"{m:7} {r.trainable:11,} {r.trainable / full.trainable:7.3f} {r.peak.total / 2**20:9.2f} "
                  f"{r.peak.total / full.peak.total:7.3f} {r.seconds:8.2f} {r.seconds / full.seconds:7.3f} "
                  f"{r.before:6.3f} -> {r.after:6.3f} {r.after / full.after:7.3f}")
        print("* wall time of the whole training loop (same step count per method; the first steps under the Ledger)")
        print("\nclassify_task (MiniLM, First Folio or modern spelling)")
        for m, r in genre.items():
            ratio = r.after / genre["full"].after if m != "probe" else float("nan")
            print(f"  {r.row()}  accuracy ratio to full {ratio:.3f}")
        for m in ("lora", "qlora", "lisa"):
            r = adapt[m]
            summary[f"{m}_mem"] = f"{r.peak.total / full.peak.total:.3f}"
            summary[f"{m}_params"] = f"{r.trainable / full.trainable:.4f}"
            summary[f"{m}_time"] = f"{r.seconds / full.seconds:.3f}"
            summary[f"{m}_loss"] = f"{r.after / full.after:.3f}"
        for m in ("lora", "qlora"):
            summary[f"{m}_acc"] = f"{genre[m].after / genre['full'].after:.3f}"
    print("weights: " + " ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
