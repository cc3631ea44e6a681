"""MEASURE: the ledger, budgets, and the types every layer shares. A leaf: it imports no technique.

`labkit.estimate` predicts (it sums the byte formulas the technique modules own); `labkit.run` builds a
model, applies a recipe and measures real steps under the `Ledger`.
"""

from .ledger import Ledger
from .report import (CATEGORIES, PHASES, Breakdown, Category, Estimate, Measurement, Moment, MomentKind, Term, TermKey,
                     Timeline, Variant)
from .units import GiB, KiB, MiB, fmt_bytes, parse_bytes
from .budget import BudgetResult, SimulatedOutOfMemoryError, cuda_limit, run_within_budget
from .state import state_tensors
