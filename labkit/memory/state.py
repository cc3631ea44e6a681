"""The tensors an optimizer keeps in its state, found wherever they sit (the ledger tags them OPT)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

# torch.optim's state tensors per parameter, each of the parameter's shape and dtype: SGD none, with
# momentum its buffer, Adam and AdamW exp_avg and exp_avg_sq (their float32 step counters apart)
TORCH_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}


def state_tensors(optimizer):
    """Every tensor in `optimizer.state`, and those held one level down as attributes of plain objects kept
    in it (galore-torch keeps a GaLoreProjector whose `ortho_matrix` is a view of all of U or Vh)."""
    for state in optimizer.state.values():
        for x in tree_flatten(state)[0]:
            if isinstance(x, torch.Tensor):
                yield x
            elif hasattr(x, "__dict__") and not isinstance(x, type):
                yield from (v for v in vars(x).values() if isinstance(v, torch.Tensor))
