"""Optimizer step inside backward: each parameter is stepped, and its gradient freed, as soon as it is accumulated.

`Tensor.register_post_accumulate_grad_hook` runs a function right after autograd has written a
parameter's `.grad` for this backward pass (all its uses summed, so a tied weight fires once). If
that function steps the parameter's own optimizer and sets `.grad = None`, the model never holds
more than about one weight gradient at a time: gradient memory drops from the sum of all parameters'
gradients to roughly the largest one (GaLore's per-layer weight update: Zhao et al. 2024, arXiv 2403.03507;
github.com/jiaweizzhao/GaLore, optimizer `galore_adamw8bit_per_layer`).

What it costs: no global view of the gradients before the step. Clipping by the total gradient
norm, gradient accumulation over micro-batches and skipping a step on inf/nan (GradScaler) all need
every gradient at once, so they do not compose with this; per-parameter clipping or the previous
step's norm are the usual substitutes. Without them the trajectory equals the ordinary loop: every
optimizer here updates each parameter from its own gradient and state only.
"""

from __future__ import annotations

import torch


# ---- the teaching version: a dict of optimizers and one hook each -----------------------------------------
def step_in_backward_naive(model: torch.nn.Module, make_optimizer) -> dict:
    """Give every trainable parameter its own `make_optimizer([p])`, stepped from a post-accumulate hook.

    Returns {parameter: optimizer}. After this, `loss.backward()` alone trains the model.
    """
    optimizers = {p: make_optimizer([p]) for p in model.parameters() if p.requires_grad}

    def hook(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)  # bytes: this gradient is free before the next one is made

    for p in optimizers:
        p.register_post_accumulate_grad_hook(hook)
    return optimizers


# ---- the real one ----------------------------------------------------------------------------------------------
class StepInBackward:
    """One `optimizer_cls` per parameter, stepped inside backward; looks enough like an optimizer for a loop.

    params: parameters or param groups as for any torch optimizer (GaLore groups with "rank" work:
        each parameter's optimizer gets its group's settings). Keywords go to every optimizer.
        Any optimizer that updates each parameter from its own gradient and state works: torch.optim's,
        and labkit.optim's 8-bit Adam, Lion, Adafactor, GaLoreAdamW and GaLoreAdamW8bit.
    `step()` and `zero_grad()` do nothing (the work happens in backward), so an ordinary training
    loop runs unchanged. `param_groups` lists every parameter's group (set "lr" there to schedule it),
    `state` maps each parameter to its state, and `state_dict()` / `load_state_dict()` resume.
    `remove()` detaches the hooks. `enabled = False` lets gradients accumulate as usual (for a
    backward that must not step, e.g. a probe).
    """

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **defaults):
        groups = list(params)
        if not groups:
            raise ValueError("params: got no parameters")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for group in groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            plist = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
            for p in plist:
                if p in self.optimizers:
                    raise ValueError("params: a parameter appears more than once")
                if p.requires_grad:
                    self.optimizers[p] = optimizer_cls([{"params": [p], **settings}], **defaults)
        self.enabled = True
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.optimizers]

    def _hook(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        opt = self.optimizers[p]
        opt.step()
        opt.zero_grad(set_to_none=True)

    # ---- what a training loop and the Ledger look at -----------------------------------------------------------
    def step(self, closure=None):
        """Nothing to do: every parameter was stepped during backward. Runs `closure` if given."""
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are already None after their step; clears any left by a backward with `enabled=False`."""
        for p in self.optimizers:
            p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}

    def state_dict(self) -> dict:
        """{"optimizers": [each parameter's optimizer state_dict, in parameter order]}."""
        return {"optimizers": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"state_dict: holds {len(saved)} optimizers, this has {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers.values(), saved):
            opt.load_state_dict(sd)

    def remove(self) -> None:
        """Detach the hooks: backward accumulates gradients normally again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        kinds = {type(o).__name__ for o in self.optimizers.values()}
        return f"StepInBackward({len(self.optimizers)} parameters, {'/'.join(sorted(kinds))})"
