"""`labkit estimate`'s screen is the peak (issue 43, item 7): the terms printed are those alive at
the peak moment, they sum to the printed peak, each option visibly changes them, the whole step's
terms are a flag away; --json carries them with the layout and the model's parameters; the offload
options print what they keep off the device."""

import json
import os

import pytest

from labkit.cli import main
from labkit.estimate import Recipe, estimate
from labkit.estimate.host import (Medium, activation_offload_needs, host_needs,
                                  optimizer_offload_needs)
from labkit.estimate.spec import spec_from
from labkit.memory.report import Category, MomentKind, TermKey
from labkit.memory.units import fmt_bytes

TINY = ["estimate", "--model", "gpt2-tiny"]
BASE = TINY + ["--batch", "4", "--seq", "64", "--dtype", "mixed-bf16", "--json"]
RECIPES = {
    "checkpoint none": [],
    "checkpoint full": ["--checkpoint", "full"],
    "step in backward": ["--checkpoint", "full", "--step-in-backward"],
    "offload activations": ["--offload-activations"],
    "qlora": ["--lora-rank", "4", "--quant", "nf4"],
    "foreach on cuda": ["--device", "cuda", "--batch", "1", "--seq", "8"],
}


def _json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def _peak_bytes(d: dict, category: str, key: str | None = None) -> int:
    return sum(t["bytes"] for t in d["peak_terms"]
               if t["category"] == category and key in (None, t["key"]))


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_peak_terms_sum_to_the_peak(capsys, name):
    d = _json(capsys, *BASE, *RECIPES[name])
    terms = d["peak_terms"]
    assert terms and sum(t["bytes"] for t in terms) == d["peak"]
    assert all(set(t) == {"key", "name", "category", "bytes", "block"} for t in terms)
    assert {t["key"] for t in terms} <= {k.name.lower() for k in TermKey}
    assert {t["category"] for t in terms} <= set(d["categories"])
    for cat, b in d["categories"].items():  # the breakdown at the peak: the same terms
        assert _peak_bytes(d, cat) == b


def test_each_option_changes_the_peak_terms(capsys):
    none = _json(capsys, *BASE)
    full = _json(capsys, *BASE, "--checkpoint", "full")
    sib = _json(capsys, *BASE, "--checkpoint", "full", "--step-in-backward")
    off = _json(capsys, *BASE, "--offload-activations")
    # checkpointing: the peak holds fewer activations (the whole-step table showed the same)
    assert _peak_bytes(full, "act") < _peak_bytes(none, "act")
    # step in backward: the gradients made so far are stepped and freed
    assert _peak_bytes(sib, "grad") < _peak_bytes(full, "grad")
    # activation offload: the saved activations are in host memory, not on the device
    assert _peak_bytes(off, "act") < _peak_bytes(none, "act") / 100
    cpu = _json(capsys, *BASE, "--batch", "1", "--seq", "8")
    cuda = _json(capsys, *BASE, "--batch", "1", "--seq", "8", "--device", "cuda")
    # AdamW's foreach path on CUDA: its temporaries, a whole parameter set, a term of the peak
    temps = {d["device"]: _peak_bytes(d, "temp", "optimizer_temps") for d in (cpu, cuda)}
    params = _peak_bytes(cuda, "param", "parameters")
    assert cuda["peak_moment"]["kind"] == "optimizer_step"
    assert temps["cuda"] == params > temps["cpu"] > 0


def test_the_text_lists_the_peak_terms_and_the_whole_step_a_flag_away(capsys):
    argv = BASE[:-1] + ["--checkpoint", "full"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    e = estimate("gpt2-tiny", 4, 64, "mixed-bf16", checkpoint="full")
    blocks = next(t for t in e.terms if t.key is TermKey.SAVED_ACTIVATIONS)
    size = fmt_bytes(blocks.bytes)  # the whole step's blocks' activations: not alive at the peak
    assert "the terms alive at the peak" in out and size not in out
    assert "all terms of the step" not in out
    assert f"sum: {fmt_bytes(e.peak.total)} = the peak" in " ".join(out.split())
    assert main(argv + ["--all-terms"]) == 0
    every = " ".join(capsys.readouterr().out.split())  # a long cell wraps at its words
    assert size in every and "all terms of the step (--all-terms)" in every
    assert "is not the peak" in every


def test_json_carries_the_layout_and_the_models_parameters(capsys):
    rows = ["--batch", "8", "--seq", "32", "--dp", "2"]
    d = _json(capsys, *TINY, *rows, "--zero", "1", "--json")
    assert "batch" not in d and d["global_batch"] == 8
    assert d["layout"] == {"dp": 2, "zero": 1, "tp": 1, "pp": 1, "rank_batch": 4, "micro_batch": 4}
    acc = _json(capsys, *TINY, *rows, "--accumulate", "2", "--json")
    assert acc["layout"] == {"dp": 2, "zero": 0, "tp": 1, "pp": 1, "rank_batch": 4,
                             "micro_batch": 2}
    assert d["n_params"] == spec_from("gpt2-tiny").n_params
    assert sum(t["bytes"] for t in d["peak_terms"]) == d["peak"]
    assert d["measures"] == "allocated" and d["host"] == []


# ----------------------------------------------------------------------------- host RAM and disk
def _host_arrays(opt) -> tuple[int, int]:
    """(bytes in RAM, bytes on disk) of an OffloadAdamW's host arrays, from its arrays and files."""
    seen, ram = set(), 0
    for h in opt.host.values():
        for x in (h.master, h.exp_avg, h.exp_avg_sq):
            st = x.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                ram += st.nbytes()
    scratch = opt._grad32.untyped_storage().nbytes() + opt._denom.untyped_storage().nbytes()
    if opt.folder is None:
        return ram + scratch, 0
    files = [os.path.join(opt.folder, f) for f in os.listdir(opt.folder)]
    return scratch, sum(os.path.getsize(f) for f in files)


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_optimizer_offload_host_bytes_are_offloadadamws_arrays(tmp_path, where):
    from labkit.optim import OffloadAdamW
    from labkit.run.step import build_model

    r = Recipe("gpt2-tiny", 2, 16, "fp32", optimizer_offload=where)
    needs = optimizer_offload_needs(r)
    m = build_model("gpt2-tiny", "fp32")
    folder = str(tmp_path) if where == "disk" else None
    with OffloadAdamW(m.parameters(), offload=where, folder=folder) as opt:
        ram, disk = _host_arrays(opt)
    want = {med: sum(h.bytes for h in needs if h.medium is med) for med in Medium}
    assert (want[Medium.RAM], want[Medium.DISK]) == (ram, disk)
    # made of the estimate's terms: master, m and v are 3 x the fp32 parameters term
    params = next(t.bytes for t in estimate(r).terms if t.key is TermKey.PARAMETERS)
    state = next(h for h in needs if h.medium is (Medium.DISK if where == "disk" else Medium.RAM))
    assert state.bytes == 3 * params
    # on CUDA a pinned staging copy of the weights in their device dtype comes on top, in RAM
    cuda = optimizer_offload_needs(r.replace(device="cuda", dtype="bf16"))
    assert sum(h.bytes for h in cuda) - sum(h.bytes for h in needs) == params // 2


def test_activation_offload_host_bytes(monkeypatch):
    """At most what the step without offload holds at the loss (its activation terms); measured:
    the bytes labkit.recompute.offload_activations copies to the host in one micro-batch, within
    0.2 % with nothing checkpointed. The difference, named: a token-id storage it does not copy
    (2 KiB here) and, under autocast, the biases' 16-bit copies (2 x 1,152 B: addmm's backward does
    not save its bias)."""
    import labkit.recompute as recompute
    from labkit.run.step import measure_step

    seen = []

    class Counting(recompute.offload_activations):
        def __exit__(self, *exc):
            seen.append(self.stats.offloaded)
            return super().__exit__(*exc)

    monkeypatch.setattr(recompute, "offload_activations", Counting)
    for dtype in ("fp32", "mixed-bf16"):
        r = Recipe("gpt2-tiny", 4, 64, dtype, offload_activations=True)
        (need,) = activation_offload_needs(r)
        plain = estimate(r.replace(offload_activations=False))
        loss = next(m for m in plain.moments if m.kind is MomentKind.LOSS)
        made_of = [t for t in loss.terms
                   if t.category is Category.ACT or t.key is TermKey.COPIES_16BIT]
        assert need.medium is Medium.RAM and need.at_most
        assert need.bytes == sum(t.bytes for t in made_of)
        seen.clear()
        measure_step(r, steps=1)
        print(f"{dtype}: host RAM up to {need.bytes:,} B; offloaded {max(seen):,} B")
        assert max(seen) <= need.bytes < 1.002 * max(seen)
    assert host_needs(Recipe("gpt2-tiny", 4, 64)) == []


def test_offload_prints_host_ram_and_disk(capsys):
    rows = ["--batch", "2", "--seq", "16", "--optimizer-offload", "disk"]
    assert main(TINY + rows + ["--offload-activations"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "off the device (the offload options):" in flat
    assert "disk needed:" in flat and "host RAM needed: up to" in flat
    d = _json(capsys, *TINY, *rows, "--json")
    r = Recipe("gpt2-tiny", 2, 16, "mixed-bf16", optimizer_offload="disk")
    assert d["host"] == [h.as_dict() for h in host_needs(r)]
    assert {h["medium"] for h in d["host"]} == {"ram", "disk"}
