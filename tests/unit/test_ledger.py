"""The ledger against PyTorch's MemTracker, and its bookkeeping on views, frees and phases."""

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from labkit.estimate import Recipe
from labkit.memory import Category, Ledger, Measurement, SimulatedOutOfMemoryError
from labkit.run import build_model, make_optimizer, train_step
from labkit.models.gpt import GPTConfig

WORKLOADS = {
    "gpt fp32 adamw": (GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64), "fp32", "adamw"),
    "gpt manual+dropout sgd-momentum": (
        GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, attention="manual", dropout=0.1), "fp32", "sgd-momentum"),
    "gpt mixed-bf16 adam": (GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64), "mixed-bf16", "adam"),
    "hf gpt2-tiny fp32 adamw": ("gpt2-tiny", "fp32", "adamw"),
    "hf llama-tiny bf16 sgd": ("llama-tiny", "bf16", "sgd"),
    "hf llama-tiny mixed-bf16 adamw": ("llama-tiny", "mixed-bf16", "adamw"),
}


def _batch(vocab, B=4, S=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (B, S + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_peak_matches_memtracker(name):
    model, dtype, optimizer = WORKLOADS[name]
    torch.manual_seed(0)
    m = build_model(model, dtype)
    opt = make_optimizer(m, optimizer)
    x, y = _batch(m.config.vocab_size)
    train_step(m, opt, x, y, dtype)  # warm-up: optimizer state exists, as in steady state
    mt = MemTracker()
    mt.track_external(m, opt)
    with mt:
        train_step(m, opt, x, y, dtype)
    ref = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with Ledger(m, opt) as led:
        train_step(m, opt, x, y, dtype)
    ours = led.measurement().peak.total
    assert abs(ours - ref) <= 0.01 * ref, (ours, ref)


def test_views_and_inplace_ops_are_not_new_memory():
    with Ledger() as led:
        a = torch.ones(1000)  # 4000 bytes
        b = a.view(10, 100)
        a.add_(1)
        c = b.t()
        assert led.live_bytes == 4000
        d = a * 2
        assert led.live_bytes == 8000
        del d
        assert led.live_bytes == 4000
    del a, b, c


def test_resize_is_tracked():
    with Ledger() as led:
        a = torch.empty(10)
        a.resize_(1000)
        assert led.live_bytes == 4000


def test_categories_and_phases_over_several_steps():
    torch.manual_seed(0)
    m = build_model(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))
    opt = make_optimizer(m, "adamw")
    x, y = _batch(256, 2, 16)
    param_bytes = sum(p.numel() * 4 for p in m.parameters())
    with Ledger(m, opt) as led:
        for _ in range(3):
            train_step(m, opt, x, y)
        live = led.live()
    meas = led.measurement()
    phases = [(p, s) for _, p, s in meas.timeline.phase_starts]
    assert phases == [(p, s) for s in (1, 2, 3) for p in ("forward", "backward", "optimizer")]
    assert live[Category.PARAM] == param_bytes
    # Adam: m and v in fp32, plus one 4-byte step counter per parameter tensor
    assert live[Category.OPT] == 2 * param_bytes + 4 * len(list(m.parameters()))
    assert live[Category.GRAD] == 0 and live[Category.ACT] == 0  # set to None, freed
    assert meas.phases["optimizer"][Category.GRAD] == param_bytes
    assert meas.phases["backward"][Category.ACT] > 0
    assert len(meas.timeline.total) == len(meas.timeline.bytes[Category.ACT]) > 100


def test_live_tensors_names_the_ops():
    with Ledger() as led:
        a = torch.randn(64, 64)
        b = a @ a
        rows = led.live_tensors()
    assert rows[0][0] in ("mm", "randn") and rows[0][3] == 64 * 64 * 4
    del b


def test_frozen_parameters_are_accepted_and_tagged_when_unfrozen_later():
    """torch refuses a grad hook on a frozen parameter; the Ledger must still start, leave it frozen,
    and tag its gradient GRAD if it is unfrozen inside the block (LISA switching layers)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    model[0].requires_grad_(False)
    model.register_buffer("codes", torch.zeros(8, dtype=torch.uint8))  # integer state is not a parameter problem
    x = torch.randn(8, 16)
    with Ledger(model) as led:
        assert not model[0].weight.requires_grad  # left as it was
        model(x).sum().backward()
        assert model[0].weight.grad is None
        model[0].requires_grad_(True)  # unfrozen inside the block
        model(x).sum().backward()
    grads = {id(p.grad.untyped_storage()) for p in model.parameters()}
    assert len(grads) == 4
    assert led.measurement().peak[Category.GRAD] == 4 * (16 * 16 + 16 + 16 * 4 + 4)  # both layers' gradients


@pytest.mark.parametrize("optimizer", ["adamw", "galore"])
def test_final_breakdown_holds_all_optimizer_state(optimizer):
    """Measurement.final: live bytes when the ledger stops. GaLore's optimizer-phase peak falls in step 1,
    before all its state exists; the final breakdown has all of it, as labkit.optim.state_bytes counts it."""
    from labkit.optim import state_bytes

    torch.manual_seed(0)
    m = build_model(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))
    opt = make_optimizer(m, Recipe(m, 2, 16, optimizer=optimizer, rank=8 if optimizer == "galore" else None))
    x, y = _batch(256, 2, 16)
    with Ledger(m, opt) as led:
        for _ in range(2):
            train_step(m, opt, x, y)
    meas = led.measurement()
    assert meas.final[Category.OPT] == state_bytes(opt) > 0
    assert meas.final[Category.PARAM] == sum(p.numel() * 4 for p in m.parameters())
    assert meas.final[Category.GRAD] == meas.final[Category.ACT] == 0
    assert meas.final.total == meas.timeline.total[-1]
    hand = Measurement("by hand", {"forward": meas.final}, meas.timeline, meas.baseline)
    assert hand.final is None  # still optional where a Measurement is built by hand


class _Projector:
    def __init__(self, n):
        self.matrix = torch.zeros(n)  # a tensor held as an attribute of an object in the state (galore-torch)


class _HoldsObjects(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            self.state[p].setdefault("projector", _Projector(1000))
        return super().step(closure)


def test_tensors_inside_objects_in_optimizer_state_count_as_state():
    model = torch.nn.Linear(4, 4)
    opt = _HoldsObjects(model.parameters(), lr=0.1)
    with Ledger(model, opt) as led:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert led.measurement().final[Category.OPT] == 2 * 4000  # weight's and bias's projector


# ---- storages resized in place (FSDP / ZeRO-3 free and re-grow parameters this way) ----------------
def _fsdp_like(n_layer=4, width=256, shards=4, seed=0):
    """Each weight lives as a 1/shards flat shard; its full storage is re-grown with resize_ before use and
    freed with resize_(0) after, in forward and in backward, as FSDP does with unsharded parameters."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n_layer)])
    full = {p: p.numel() * p.element_size() for p in model.parameters()}
    shard = {p: p.detach().reshape(-1)[: p.numel() // shards].clone() for p in model.parameters()}

    def grow(p):
        if p.untyped_storage().nbytes() == 0:
            p.untyped_storage().resize_(full[p])
            p.data.view(-1).zero_()[: shard[p].numel()].copy_(shard[p])

    def free(p):
        p.untyped_storage().resize_(0)

    for mod in model:
        mod.register_forward_pre_hook(lambda m, a: grow(m.weight))
        mod.register_forward_hook(lambda m, a, o: free(m.weight))
        mod.register_full_backward_pre_hook(lambda m, g: grow(m.weight))
        mod.weight.register_post_accumulate_grad_hook(free)
    for p in model.parameters():
        free(p)
    return model, full


def _fsdp_step(model):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0), requires_grad=True)  # the batch
    model(x).square().sum().backward()
    for p in model.parameters():
        p.grad = None


def test_resized_storages_match_memtracker():
    m, full = _fsdp_like()
    mt = MemTracker()
    mt.track_external(m)
    with mt:
        _fsdp_step(m)
    ref = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with Ledger(m) as led:
        _fsdp_step(m)
    meas = led.measurement()
    assert abs(meas.peak.total - ref) <= 0.01 * ref, (meas.peak.total, ref)
    # one layer's weight is unsharded at a time; every weight is freed again at the end
    assert meas.peak[Category.PARAM] == max(full.values())
    assert meas.final[Category.PARAM] == 0
    assert torch.UntypedStorage.resize_ is torch.UntypedStorage.__dict__["resize_"]  # restored on exit


def test_resize_growth_counts_against_the_budget():
    m, full = _fsdp_like()
    with Ledger(m) as led:
        _fsdp_step(m)
    peak = led.measurement().peak.total
    with Ledger(m, budget=peak):
        _fsdp_step(m)
    with pytest.raises(SimulatedOutOfMemoryError, match="resize_"):
        with Ledger(m, budget=max(full.values()) - 1):
            _fsdp_step(m)
    for p in m.parameters():  # the failed step left a weight grown: free it for the next user
        p.untyped_storage().resize_(0)


def test_resize_is_restored_after_an_error():
    orig = torch.UntypedStorage.resize_
    with pytest.raises(ZeroDivisionError):
        with Ledger():
            1 / 0
    assert torch.UntypedStorage.resize_ is orig
