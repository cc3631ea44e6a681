"""The planner: which training configuration to use for a model, some devices and a memory budget.

It searches precision, checkpointing, micro-batches, optimizers, offload, PEFT and (with several devices) data,
tensor and pipeline parallelism with ZeRO; keeps what labkit's estimator says fits; ranks the rest by fidelity,
then by a documented cost model's step time (labkit.plan.cost); and can check a plan by running it (verify).

    >>> from labkit.plan import plan
    >>> best = plan("llama2-7b", devices=1, memory="24GiB", batch=1, seq=512)[0]   # doctest: +SKIP
    >>> best.summary(), best.peak, best.binding, best.why                          # doctest: +SKIP

From a shell: `python -m labkit plan --model llama2-7b --memory 24GiB --tokens 1*512`.
"""

from .cost import Fidelity, StepTime, step_time
from .devices import PRESETS, Device, get_device
from .search import NoPlanError, Plan, SearchOptions, plan
from .verify import Verification, verify
