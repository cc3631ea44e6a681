"""Quantization: the 8-bit dynamic map and blockwise absmax quantization shared by optimizers and weights,
int8 weights (absmax / zero-point), NF4 weights with double quantization, group-wise int4 (round-to-nearest) and
AWQ's activation-aware scales."""

from .dynamic import dequantize_blockwise, dynamic_map, quantize_blockwise
from .matmul import DequantMatmul, dequant_linear
from .int8 import (
    Int8Linear,
    Int8Tensor,
    absmax_dequantize,
    absmax_quantize,
    dequantize_int8,
    int8_bytes_for,
    quant_error,
    quantize_int8,
    zeropoint_dequantize,
    zeropoint_quantize,
)
from .nf4 import (
    NF4_CODE,
    NF4Linear,
    NF4State,
    bits_per_param_nf4,
    dequantize_nf4,
    dequantize_nf4_toy,
    nbytes_nf4,
    nf4_bytes_for,
    normal_float_map,
    pack_nibbles,
    quantize_nf4,
    quantize_nf4_toy,
    nf4_linear,
    unpack_nibbles,
)
from .int4 import (
    INT4_GROUP,
    Int4Linear,
    Int4Tensor,
    dequantize_int4,
    fake_quantize_int4,
    int4_bytes_for,
    quantize_int4,
)
from .awq import (
    AWQConfig,
    AWQGroup,
    AWQReport,
    InputStats,
    awq_groups,
    awq_linear,
    awq_quantize,
    awq_scale,
    collect_inputs,
    input_stats,
    keep_salient,
    linear_names,
    rtn_quantize,
    search_clip,
    search_scale,
)
