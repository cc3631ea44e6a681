"""PREDICT: the bytes of one training step, as moments made of named terms, from a shape-only walk of the model.

It sums the byte formulas that the technique modules own (labkit.optim, labkit.quant, labkit.peft) and
never re-derives one; `labkit.memory` holds the result types.
"""

from .estimator import estimate, estimate_ranks, paging
from .predict import DTYPES, OPTIMIZERS, Precision
from .recipe import Recipe
from .peft_terms import QUANTS
from .moments import POLICIES
from .spec import ModelSpec, spec_from
from .wall import METHODS, fit_table
