"""Predict and measure training memory: the spine every lesson stands on."""

from .ledger import Ledger
from .report import CATEGORIES, PHASES, Breakdown, Category, Estimate, Measurement, Term, Timeline
from .units import GiB, KiB, MiB, fmt_bytes, parse_bytes
from .estimate import DTYPES, OPTIMIZERS, Precision, estimate
from .peft_terms import QUANTS
from .budget import BudgetResult, SimulatedOutOfMemoryError, cuda_limit, run_within_budget
from .runner import apply_peft, build_model, make_optimizer, measure_step, train_step
from .spec import ModelSpec, spec_from
from .wall import METHODS, fit_table
