"""labkit: train large models with limited memory, predicting and measuring every byte."""

from labkit.session import optional_import, quiet_known_warnings, setup

__version__ = "0.1.0"
__all__ = ["optional_import", "quiet_known_warnings", "setup"]
