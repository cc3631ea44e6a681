"""Precision: loss scaling, fp32 master weights with 16-bit working copies, and FP8 emulation."""

from .scaler import DynamicLossScaler
from .master import (BytesPerParam, MasterWeightsOptimizer, bytes_per_param, make_masters, naive_master_step,
                     streamed_grad_peak)
from .underflow import UnderflowReport, flush_fraction, gradient_underflow_report, overflow_fraction
from .fp8 import (FP8Linear, FP8MemoryReport, FP8Recipe, dequantize_fp8, fp8_error, fp8_gemm_available,
                  fp8_memory_report, outlier_demo, quantize_fp8, scaled_mm_fp8, swap_to_fp8)
