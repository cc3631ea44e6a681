"""labkit's AWQ against AutoAWQ's (casper-hansen/AutoAWQ 0.2.9, awq/quantize/quantizer.py) on the CPU.

    pip download --no-deps autoawq==0.2.9 && tar xzf autoawq-0.2.9.tar.gz
    PYTHONPATH=.:autoawq-0.2.9 python bench/awq_parity.py

AutoAWQ is not a labkit dependency (it pins old transformers and wants CUDA kernels to run a model), but
its search functions are plain torch: this script imports AwqQuantizer with the `datasets` import stubbed
(only its calibration loader uses it) and calls, on a LayerNorm -> Linear block whose input has a few
large channels:
  - pseudo_quantize_tensor (w_bit 4, zero point) vs labkit.quant.fake_quantize_int4(scale_dtype=fp32),
  - _search_best_scale (duo_scaling=False: the paper's s = s_x^alpha, and True, AutoAWQ's default) vs
    labkit.quant.search_scale(duo=...),
  - _compute_best_clip vs labkit.quant.search_clip (ratio x absmax = AutoAWQ's max value).
labkit stores its steps in fp16 and always includes 0 in a group's range; with fp32 steps and groups that
straddle 0 (all of them here) the two round trips are the same function. The last line is the summary.
"""

from __future__ import annotations

import copy
import sys
import types

import torch
import torch.nn as nn

from labkit.quant import Int4Linear, fake_quantize_int4, search_clip, search_scale


def autoawq():
    sys.modules.setdefault("datasets", types.SimpleNamespace(load_dataset=None))  # only the calibration loader
    from awq.quantize.quantizer import AwqQuantizer

    q = AwqQuantizer.__new__(AwqQuantizer)  # the search methods only read these attributes
    q.w_bit, q.group_size, q.zero_point, q.duo_scaling, q.max_chunk_memory = 4, 64, True, False, 1024 ** 3
    q.n_parallel_calib_samples = None
    return q


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_in)
        self.fc = nn.Linear(d_in, d_out)


def main() -> None:
    torch.manual_seed(0)
    q = autoawq()
    d_in, d_out, tokens = 256, 128, 384
    block = Block(d_in, d_out)
    x = torch.randn(tokens, d_in)
    x[:, :4] *= 30  # four salient channels (about 1.5 %)
    w = block.fc.weight.detach().clone()

    theirs = q.pseudo_quantize_tensor(w.clone())[0]
    ours = fake_quantize_int4(w, 64, scale_dtype=torch.float32)
    rt = (theirs - ours).abs().max().item()

    with torch.no_grad():
        b = copy.deepcopy(block)  # a fresh copy per search: on the CPU, AutoAWQ's state_dict "backup" (.cpu())
        _, _, s_theirs = q._search_best_scale(b, b.ln, [b.fc], x.clone())  # shares the weights' storage
        q.duo_scaling = True  # AutoAWQ's default: s = s_x^alpha / s_w^(1 - alpha)
        b = copy.deepcopy(block)
        _, _, s_duo = q._search_best_scale(b, b.ln, [b.fc], x.clone())
        drift = (b.fc.weight - w).abs().max().item()  # a search should leave the weight as it found it
    res = search_scale([w], x, 64, scale_dtype=torch.float32)
    ds = ((s_theirs - res.scale).abs().max() / res.scale.abs().max()).item()
    res_duo = search_scale([w], x, 64, scale_dtype=torch.float32, duo=True)
    ds_duo = ((s_duo - res_duo.scale).abs().max() / res_duo.scale.abs().max()).item()

    ws = w * res.scale  # the clip search on the scaled weight and the unscaled input, as AutoAWQ runs it
    xs = x / res.scale
    with torch.no_grad():
        max_theirs = q._compute_best_clip(ws.clone(), xs.clone()).squeeze(-1)  # (d_out, groups)
    ratio = search_clip(ws, xs, 64, scale_dtype=torch.float32)
    max_ours = ws.view(d_out, -1, 64).abs().amax(-1) * ratio
    same_clip = torch.isclose(max_theirs, max_ours, rtol=1e-6).float().mean().item()
    # the layer's output: AutoAWQ's clipped, scaled fp32 round trip vs labkit's Int4Linear (fp16 s and steps)
    with torch.no_grad():
        lim = max_theirs.repeat_interleave(64, dim=1)
        w_theirs = q.pseudo_quantize_tensor(torch.maximum(torch.minimum(ws, lim), -lim))[0] / res.scale
        y_theirs, y_fp = x @ w_theirs.T + block.fc.bias, block.fc(x)
        y_ours = Int4Linear.from_linear(block.fc, 64, res.scale, ratio)(x)
    d_out_rel = ((y_ours - y_theirs).norm() / y_fp.norm()).item()
    q_err = ((y_theirs - y_fp).norm() / y_fp.norm()).item()
    print(f"pseudo-quantize: max |AutoAWQ - labkit| = {rt:.2e}")
    print(f"scale search: alpha {res.alpha:.2f}; max relative |s difference| {ds:.2e}; errors over the grid "
          f"{' '.join(f'{e:.3g}' for e in res.errors[:6])} ...")
    print(f"duo scaling: alpha {res_duo.alpha}; max relative |s difference| {ds_duo:.2e}; AutoAWQ's duo search "
          f"left its weight changed by up to {drift:.2e} (its backup shares storage on the CPU), so this one is no reference")
    print(f"clip search: {same_clip:.2%} of the (row, group) clip values equal")
    print(f"layer output: |labkit - AutoAWQ| / |y| = {d_out_rel:.2e} (fp16 steps and scales), against the int4 "
          f"error itself |AutoAWQ - fp32| / |y| = {q_err:.2e}")
    print(f"awq_parity: pseudo_quant_max_diff={rt:.2e} scale_max_rel_diff={ds:.2e} duo_scale_max_rel_diff={ds_duo:.2e} duo_weight_drift={drift:.2e} clip_equal={same_clip:.4f} "
          f"output_rel_diff={d_out_rel:.2e} int4_rel_err={q_err:.2e}")


if __name__ == "__main__":
    main()
