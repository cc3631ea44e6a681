"""labkit: train large models with limited memory, predicting and measuring every byte."""

__version__ = "0.1.0"
