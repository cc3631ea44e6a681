"""Predict and measure training memory: the spine every lesson stands on."""

from .ledger import Ledger, SimulatedOutOfMemoryError
from .report import CATEGORIES, PHASES, Breakdown, Category, Estimate, Measurement, Term, Timeline
from .units import GiB, KiB, MiB, fmt_bytes, parse_bytes
from .estimate import DTYPES, OPTIMIZERS, Precision, estimate
from .runner import BudgetResult, build_model, cuda_limit, make_optimizer, measure_step, run_within_budget, train_step
from .spec import ModelSpec, spec_from
from .wall import fit_table
