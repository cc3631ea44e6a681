"""Precision: loss scaling, fp32 master weights with 16-bit working copies, and FP8 emulation."""

from .scaler import DynamicLossScaler
