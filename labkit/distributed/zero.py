"""ZeRO stages 1, 2 and 3 from scratch: data-parallel ranks that each keep only their shard of the model states.

Rajbhandari et al. 2020 (arXiv 1910.02054), section 5: with N ranks and Psi parameters,

    stage 1 (P_os)      each rank keeps 1/N of the optimizer state     (it steps only its shard)
    stage 2 (P_os+g)    ... and 1/N of the gradients                   (reduce-scattered during backward)
    stage 3 (P_os+g+p)  ... and 1/N of the parameters                  (all-gathered just in time, freed after use)

The model is cut into units: each block of its block list, and the root (everything else: embeddings,
final norm, head). Each unit's parameters live in one flat fp32 buffer of n elements, padded to a multiple
of N and cut into N equal shards; rank r owns elements [r s, (r+1) s), s = ceil(n / N). The model's
parameters are views of the flat buffer (`p.data = flat[o:o+k].view(shape)`), so the model runs unchanged.

    stage   parameters on a rank       gradients on a rank                        optimizer state
    1       every unit's flat buffer   full until the step, then reduce-scattered  AdamW on the shards
    2       every unit's flat buffer   a unit's full gradients until its backward  AdamW on the shards
                                       ends, then only the shard
    3       the shards; a unit's flat  as stage 2                                  AdamW on the shards
            buffer only while it runs

Stage 3 frees a unit's flat buffer with `untyped_storage().resize_(0)` and regrows it before use (as FSDP
does), so tensors autograd saved from the parameters see the gathered values again in backward. The root
unit stays gathered from the forward's start to the end of backward (as FSDP2 keeps its root).

After the optimizer step (on the shards), stages 1 and 2 all-gather every unit's shards into its flat
buffer. `offload=True` (ZeRO-Offload, Ren et al. 2021) runs the shards' AdamW on host memory with
`labkit.optim.OffloadAdamW`. Communication per step and rank (ring algorithms, `comms.wire_bytes`):
stages 1-2 a reduce-scatter and an all-gather of the parameters' bytes (2 Psi elements, as an all-reduce);
stage 3 one more all-gather (forward and backward each gather): 3 Psi.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from . import comms

__all__ = ["Zero", "Unit", "units_of"]

STAGES = (1, 2, 3)


def units_of(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """(name, modules) of each unit: every module of the model's first ModuleList (its blocks), then the root
    (the model itself, holding every parameter not in a block)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            return [(f"{name}.{i}", [b]) for i, b in enumerate(m)] + [("root", [model])]
    return [("root", [model])]


@dataclass
class Unit:
    """One unit's flat buffer and this rank's shard of it."""

    name: str
    module: nn.Module | None  # the block (None for the root)
    params: list[nn.Parameter]  # in the flat buffer's order
    numel: int  # n: elements of its parameters
    shard: nn.Parameter  # (s,) this rank's elements: what the optimizer steps
    flat: torch.Tensor  # (N s,) the gathered buffer; the parameters are views of it
    ready: int = 0  # gradients made in this backward

    @property
    def padded(self) -> int:
        return self.flat.numel()


# what steps the shards: torch's AdamW, or labkit.optim's element-wise optimizers, which step a flat shard as
# they would any 1-D tensor (8-bit Adam's blocks run along it, as over FSDP1's flat parameters)
SHARD_OPTIMIZERS = ("adamw", "adamw8bit", "adam8bit", "lion")


class Zero(nn.Module):
    """A model trained with ZeRO stage 1, 2 or 3 over `group` (default: every rank).

        z = Zero(model, stage=3, lr=1e-3)
        loss = z(x, y); loss.backward(); z.step()        # step() also zeroes the gradients

    Every rank starts from rank 0's parameters. AdamW (torch.optim's single-tensor update, or OffloadAdamW)
    with lr, betas, eps, weight_decay runs on the shards, or `optimizer` names one of labkit.optim's
    (SHARD_OPTIMIZERS: 8-bit Adam(W) or Lion, with lr). Gradients are averaged over ranks."""

    def __init__(self, model: nn.Module, stage: int = 1, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, offload: bool = False, group=None, optimizer: str = "adamw"):
        super().__init__()
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(f"stage must be a ZeRO stage 1, 2 or 3, got {stage!r} (stage 0 is plain data "
                             f"parallel: labkit.distributed.DataParallelNaive)")
        self.module, self.stage, self.group = model, stage, group
        self.world, self.rank = comms.world(group), comms.rank(group)
        from .data_parallel import broadcast_parameters

        broadcast_parameters(model, group=group)
        self.units = self._build_units(model)
        self._by_param = {p: u for u in self.units for p in u.params}
        shards = [u.shard for u in self.units]
        if optimizer not in SHARD_OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(SHARD_OPTIMIZERS)} (each steps a flat shard "
                             f"as a tensor), got {optimizer!r}")
        if offload and optimizer != "adamw":
            raise ValueError(f"offload runs OffloadAdamW: give optimizer='adamw', not {optimizer!r}")
        if offload:
            from labkit.optim import OffloadAdamW

            self.optimizer = OffloadAdamW(shards, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        elif optimizer != "adamw":  # labkit.optim's: block-wise 8-bit Adam(W) over the flat shard, or Lion
            from labkit import optim as lo

            cls = {"adamw8bit": lo.AdamW8bit, "adam8bit": lo.Adam8bit, "lion": lo.Lion}[optimizer]
            self.optimizer = cls(shards, lr=lr)
        else:
            self.optimizer = torch.optim.AdamW(shards, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                               foreach=False)
        self._hooks = []
        if stage >= 2:
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._by_param]
        if stage == 3:
            self._hooks.append(model.register_forward_pre_hook(lambda *_: self._gather(self.units[-1])))
            for u in self.units[:-1]:
                self._hooks.append(u.module.register_forward_pre_hook(lambda *_, u=u: self._gather(u)))
                self._hooks.append(u.module.register_forward_hook(lambda m, a, out, u=u: self._after_forward(u, out)))

    # ---- building the flat buffers ------------------------------------------------------------------
    @torch.no_grad()
    def _build_units(self, model: nn.Module) -> list[Unit]:
        taken: set[int] = set()
        out = []
        for name, mods in units_of(model):
            params = []
            for m in mods:
                for p in m.parameters():
                    if id(p) not in taken and p.requires_grad:
                        taken.add(id(p))
                        params.append(p)
            n = sum(p.numel() for p in params)
            if n == 0:
                continue
            if n < self.world:
                raise ValueError(f"unit {name!r} has {n} parameter elements, fewer than the {self.world} ranks "
                                 f"to shard them over: use fewer ranks or larger units")
            s = math.ceil(n / self.world)
            flat = torch.zeros(s * self.world, dtype=params[0].dtype, device=params[0].device)  # (N s,)
            offset = 0
            for p in params:
                if p.dtype != flat.dtype:
                    raise ValueError(f"unit {name!r} mixes dtypes {p.dtype} and {flat.dtype}: one flat buffer "
                                     f"holds one dtype")
                k = p.numel()
                flat[offset:offset + k].copy_(p.reshape(-1))
                p.data = flat[offset:offset + k].view(p.shape)
                offset += k
            lo = self.rank * s
            if self.stage == 3:  # the shard is its own storage; the flat buffer comes and goes
                shard = nn.Parameter(flat[lo:lo + s].clone())
                flat.untyped_storage().resize_(0)
            else:  # the shard is a view of the flat buffer: the step updates the model in place
                shard = nn.Parameter(flat[lo:lo + s])
            module = mods[0] if name != "root" else None
            out.append(Unit(name, module, params, n, shard, flat))
        return out

    # ---- stage 3: gather before use, free after --------------------------------------------------------
    @torch.no_grad()
    def _gather(self, u: Unit) -> None:
        st = u.flat.untyped_storage()
        if st.nbytes() == 0:
            st.resize_(u.padded * u.flat.element_size())
            comms.all_gather(u.flat, u.shard.detach(), group=self.group, tag=f"gather {u.name}")

    def _free(self, u: Unit) -> None:
        u.flat.untyped_storage().resize_(0)

    def _after_forward(self, u: Unit, out) -> None:
        self._free(u)
        t = out if isinstance(out, torch.Tensor) else next((o for o in out if isinstance(o, torch.Tensor)), None)
        if t is not None and t.requires_grad:  # the gradient of the unit's output: its backward starts next
            t.register_hook(lambda g, u=u: (self._gather(u), g)[1])

    # ---- gradients ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _reduce(self, u: Unit) -> None:
        """The unit's full gradients, flattened (and padded), reduce-scattered (mean) into this rank's shard
        of them; the full ones are freed."""
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=u.flat.dtype)
                 for p in u.params]
        pad = u.padded - u.numel
        full = torch.cat(grads + ([torch.zeros(pad, dtype=u.flat.dtype, device=u.flat.device)] if pad else []))
        del grads
        for p in u.params:
            p.grad = None
        if u.shard.grad is None:
            u.shard.grad = torch.empty_like(u.shard)
            comms.reduce_scatter(u.shard.grad, full, op="avg", group=self.group, tag=f"grads {u.name}")
        else:  # a later micro-batch: add to the shard already there
            part = torch.empty_like(u.shard)
            comms.reduce_scatter(part, full, op="avg", group=self.group, tag=f"grads {u.name}")
            u.shard.grad.add_(part)
        del full
        if self.stage == 3:
            self._free(u)

    def _on_grad(self, p: nn.Parameter) -> None:
        u = self._by_param[p]
        u.ready += 1
        if u.ready == len(u.params):
            u.ready = 0
            self._reduce(u)

    # ---- running it ---------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def step(self) -> None:
        """Reduce what backward has not (stage 1: every unit), step the shards, gather the parameters back
        (stages 1-2), and zero the gradients."""
        self._reduce_after_backward()
        pending = [u.name for u in self.units if u.ready]
        if pending:
            raise RuntimeError(f"ZeRO: units {pending} got only some of their gradients; every parameter must be "
                               f"used in the forward pass")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage < 3:
            for u in self.units:
                comms.all_gather(u.flat, u.shard.detach(), group=self.group, tag=f"parameters {u.name}")

    def _reduce_after_backward(self) -> None:
        """Stage 1 reduces no gradient in backward: reduce every unit that has some now."""
        if self.stage == 1:
            for u in self.units:
                if any(p.grad is not None for p in u.params):
                    self._reduce(u)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, as a new tensor on every rank (stage 3 gathers each unit into a copy)."""
        return self._whole(lambda u: u.flat if self.stage < 3 else self._gathered(u, u.shard.detach(), "read"))

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's averaged gradient, whole, on every rank: the shards' gradients gathered (after
        backward, before `step`; stage 1 reduces them first)."""
        self._reduce_after_backward()
        return self._whole(lambda u: self._gathered(u, u.shard.grad, "read grads"))

    def _gathered(self, u: Unit, shard: torch.Tensor, what: str) -> torch.Tensor:
        """A new (N s,) buffer of every rank's `shard` of unit u."""
        flat = torch.empty(u.padded, dtype=u.shard.dtype)
        comms.all_gather(flat, shard, group=self.group, tag=f"{what} {u.name}")
        return flat

    def _whole(self, flat_of) -> dict[str, torch.Tensor]:
        """{name: a copy of the whole parameter-shaped tensor} cut from each unit's buffer `flat_of(unit)`."""
        names = {p: n for n, p in self.module.named_parameters()}
        out = {}
        for u in self.units:
            flat, offset = flat_of(u), 0
            for p in u.params:
                out[names[p]] = flat[offset:offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return out

    def state_elements(self) -> dict[str, int]:
        """Elements this rank keeps: parameters, gradients (after a step's reduce) and optimizer state (Adam: 2 per
        shard element)."""
        s = sum(u.shard.numel() for u in self.units)
        full = sum(u.padded for u in self.units)
        return {"parameters": s if self.stage == 3 else full, "gradients": s, "optimizer": 2 * s}

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
