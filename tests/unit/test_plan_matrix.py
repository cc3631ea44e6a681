"""labkit.plan.matrix: the smoke bench measures every technique; the memory it reports saved comes from the
categories the technique is about; the committed matrix is a real run of the same technique list.

No test reads a time: step times are printed by the bench, never asserted on.
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from labkit.plan import matrix as mx

STATE_OPTIMIZERS = ("adamw8bit", "adafactor", "lion", "galore", "galore8bit")
CHECKPOINTING = ("ckpt_full", "ckpt_sqrt", "ckpt_selective")
BENCH = Path(__file__).resolve().parents[2] / "bench" / "selection_matrix.py"
NUMBERS = ("peak_bytes", "saved_bytes", "saved_frac", "step_s", "time_ratio", "val_loss", "loss_delta")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """bench/selection_matrix.py --smoke (one torch thread, as the bench sets), read back with load_matrix."""
    spec = importlib.util.spec_from_file_location("selection_matrix", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path_factory.mktemp("matrix") / "smoke.json"
    n = torch.get_num_threads()
    try:
        bench.main(["--smoke", "--steps", "3", "--out", str(out)])
    finally:
        torch.set_num_threads(n)
    return mx.load_matrix(out)


def _by_key(m):
    return {r["key"]: r for r in m["techniques"]}


def test_smoke_bench_measures_every_technique(smoke):
    assert smoke["size"] == "smoke" and smoke["machine"]["torch_threads"] == 1
    assert [r["key"] for r in smoke["techniques"]] == list(mx.TECHNIQUE_KEYS)
    assert len(mx.TECHNIQUE_KEYS) == 17 and len(set(mx.TECHNIQUE_KEYS)) == 17
    for r in smoke["techniques"]:
        for k in NUMBERS:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (r["key"], k, r[k])
        assert r["peak_bytes"] > 0 and r["step_s"] > 0
    b = smoke["baseline"]
    assert b["key"] == "baseline" and b["options"] == {} and math.isfinite(b["val_loss"])
    assert smoke["machine"]["cores"] >= 1 and smoke["date"]


def test_checkpointing_saves_activations(smoke):
    t = _by_key(smoke)
    for k in CHECKPOINTING:
        assert t[k]["saved_bytes"] > 0, (k, t[k]["saved_bytes"])
        assert t[k]["category_max"]["act"] < smoke["baseline"]["category_max"]["act"]
    assert t["ckpt_full"]["cuts"][0] == "act" and t["ckpt_full"]["wins_when"] == "activation-bound"
    assert t["accumulation"]["category_max"]["act"] < smoke["baseline"]["category_max"]["act"]
    for k in ("offload_act", "chunked_loss"):  # the saved activations leave the device; the loss's B S V tensors go
        assert t[k]["saved_bytes"] > 0 and t[k]["cuts"][0] == "act", (k, t[k]["cuts"])
    assert t["chunked_loss"]["options"] == {"model.loss_chunk": 16}  # a GPTConfig change, named as one


def test_optimizer_state_techniques_save_state(smoke):
    t = _by_key(smoke)
    base_opt = smoke["baseline"]["category_max"]["opt"]
    for k in STATE_OPTIMIZERS + ("offload_cpu",):
        assert t[k]["saved_bytes"] > 0, (k, t[k]["saved_bytes"])
        assert t[k]["category_max"]["opt"] < base_opt
        assert t[k]["cuts"][0] == "opt" and t[k]["wins_when"] == "state-bound"
    assert t["step_in_backward"]["category_max"]["grad"] < smoke["baseline"]["category_max"]["grad"]
    assert t["qlora"]["category_max"]["param"] < t["lora"]["category_max"]["param"]  # nf4 base vs fp32 base


def test_exact_techniques_train_as_the_baseline(smoke):
    """Recompute, host-side optimizer state and stepping in backward change where and when bytes live, not the
    arithmetic: the same loss as the baseline after the same steps (fp32's default closeness)."""
    t = _by_key(smoke)
    base = torch.tensor(smoke["baseline"]["val_loss"])
    for k in CHECKPOINTING + ("offload_cpu", "offload_act", "step_in_backward"):
        torch.testing.assert_close(torch.tensor(t[k]["val_loss"]), base, msg=k)
    assert t["adafactor"]["val_loss"] != smoke["baseline"]["val_loss"]  # another optimizer: another loss


def test_regime_flips_with_batch():
    cfg = mx._config(mx.SIZES["smoke"])
    small, big = mx.regime(cfg, 1, 4), mx.regime(cfg, 16, 16)
    assert small["regime"] == "state-bound" and big["regime"] == "activation-bound"
    assert big["activation_bytes"] > small["activation_bytes"] and big["state_bytes"] <= small["state_bytes"] + 1


def test_committed_matrix_matches_the_bench():
    m = mx.load_matrix()
    assert [r["key"] for r in m["techniques"]] == list(mx.TECHNIQUE_KEYS)
    assert [r["label"] for r in m["techniques"]] == [lab for _, lab, _ in mx.TECHNIQUES]
    assert m["size"] == "default" and m["config"]["model"] == mx.SIZES["default"]["model"]
    assert m["machine"]["cpu"] and m["date"]
    for r in m["techniques"]:
        assert all(math.isfinite(r[k]) for k in NUMBERS)
        assert r["saved_bytes"] == m["baseline"]["peak_bytes"] - r["peak_bytes"]
    rows = mx.matrix_table(m)
    assert len(rows) == len(mx.TECHNIQUES) and set(rows[0]) == set(mx.COLUMNS)


def test_plot_returns_a_labelled_figure(smoke):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    before = plt.get_fignums()
    fig = mx.plot_matrix(smoke)
    assert isinstance(fig, Figure)
    # pyplot does not hold it: `display(fig)` in a notebook shows it once (lesson 13 showed it twice)
    assert plt.get_fignums() == before
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert texts == {lab for _, lab, _ in mx.TECHNIQUES}


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="size"):
        mx.run_matrix("huge")
    with pytest.raises(ValueError, match="steps"):
        mx.run_matrix("smoke", steps=2)
    with pytest.raises(ValueError, match="unknown technique"):
        mx.technique_recipe("dropout")
    with pytest.raises(ValueError, match="unknown technique.*'dropout'"):
        mx.run_matrix("smoke", keys=["ckpt_full", "dropout"])
    with pytest.raises(ValueError, match="none given"):
        mx.run_matrix("smoke", keys=[])
    with pytest.raises(FileNotFoundError, match="bench/selection_matrix.py"):
        mx.load_matrix(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not a selection matrix"):
        mx.load_matrix(tmp_path / "x.json")


def test_times_name_their_device_and_gpu_costs_are_predicted():
    """The committed matrix was timed on a CPU, where offload moves nothing: the table and the plot say where it was
    measured, and the GPU columns are labkit.plan.cost's prediction, made of bytes over the host link / its
    bandwidth: an offloaded fp32 optimizer sends every gradient down and every parameter up, 2 x 4 B per parameter."""
    from labkit.estimate.spec import spec_from
    from labkit.plan.devices import get_device

    m = mx.load_matrix()
    head = mx.format_table(m, gpu="a10").splitlines()[0]
    assert f"measured on {mx.measured_on(m)}" in head and "PREDICTED for NVIDIA A10" in head
    assert mx.measured_on(m).startswith("cpu (")
    pred, dev = mx.predicted_gpu(m, "a10"), get_device("a10")
    n = spec_from(mx.technique_recipe("offload_cpu", m["config"]).model).n_params
    off = pred["offload_cpu"]
    assert off["host_bytes"] == 2 * 4 * n and off["parts"]["host"] > off["host_bytes"] / dev.host_bw
    act = pred["offload_act"]
    assert act["host_bytes"] > 0 and act["parts"]["host"] == act["host_bytes"] / dev.host_bw
    assert "PCIe" in act["made_of"] and pred["baseline"]["time_x"] == 1.0
    fig = mx.plot_matrix(m)
    assert "measured on cpu" in fig.axes[0].get_xlabel() and "measured on cpu" in fig.axes[0].get_title()
