"""RUN: build a model, apply a recipe (precision, recompute, optimizer, PEFT), train and measure it for real.

Above the techniques and the estimator: it wires them together; nothing below imports it.
"""

from labkit.estimate.recipe import Recipe

from .step import LISA_INTERVAL, adapters_to, apply_peft, build_model, make_optimizer, measure_step, optimizer_class, train_step
from .policies import StepFigures, activation_flops_report, format_report, measure_training_step, saved_bytes
