"""Quantization: the 8-bit dynamic map and blockwise absmax quantization shared by optimizers and weights."""

from .dynamic import dequantize_blockwise, dynamic_map, quantize_blockwise
