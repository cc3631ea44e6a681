"""labkit: train large models with limited memory, predicting and measuring every byte."""

from labkit.session import optional_import, quiet_known_warnings, setup

__version__ = "0.2.0"  # = pyproject.toml's [project] version (tests/unit/test_version.py)
__all__ = ["optional_import", "quiet_known_warnings", "setup"]
