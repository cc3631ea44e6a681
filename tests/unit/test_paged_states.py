"""Recipe.paged_states: bitsandbytes' paged optimizers (PagedAdamW, PagedAdamW8bit, ...) keep the
optimizer's states in CUDA unified memory, which max_memory_allocated does not count (issue 43, item 6).

The estimate leaves them out of every moment and reports them in Estimate.unified. A CPU has no unified
memory to page, so measure_step runs the same optimizer and takes the ledger's optimizer-state bytes out of
the device timeline as that memory (Measurement.as_unified): the prediction is checked against that.
"""

import json

import pytest
import torch

from estimate_checks import estimate_and_measure
from labkit.cli import main
from labkit.estimate import Recipe, estimate, paging
from labkit.memory import Category
from labkit.memory.report import TermKey as K
from labkit.optim.paged import PAGE_SIZE
from labkit.run import measure_step

CASES = [  # (model, options)
    ("gpt2-tiny", dict(dtype="fp32", optimizer="adamw")),
    ("llama-tiny", dict(dtype="mixed-bf16", optimizer="adamw8bit")),
    ("gpt2-tiny", dict(dtype="fp32", optimizer="adam8bit", checkpoint="full", micro_batch=2)),
    ("gpt2-tiny", dict(dtype="bf16", optimizer="lion")),
    ("llama-tiny", dict(dtype="fp32", optimizer="adamw", lora_rank=8, lora_targets="q_proj,v_proj",
                        quant="nf4")),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("model, kw", CASES, ids=[f"{m}-{k['optimizer']}" for m, k in CASES])
def test_device_peak_without_the_states_and_their_bytes_apart(model, kw):
    plain = Recipe.of(model, 4, 64, **kw)
    r = plain.replace(paged_states=True)
    e, m = estimate_and_measure(r)  # the device peak, per category, without the states
    assert all(mo.breakdown()[Category.OPT] == 0 for mo in e.moments)
    assert all(b[Category.OPT] == 0 for b in m.phases.values())
    # the unified bytes are the optimizer's state bytes: the plain estimate's term and the plain ledger's
    state = sum(t.bytes for t in estimate(plain).terms if t.key is K.OPTIMIZER_STATE)
    assert e.unified == m.unified == state > 0
    assert m.unified == max(measure_step(plain, steps=2).timeline.bytes[Category.OPT])
    assert e.peak.total < estimate(plain).peak.total
    assert "paged_states" in e.label and estimate(plain).unified == 0


def test_as_unified_moves_one_category_out_of_every_phase():
    m = measure_step(Recipe.of("gpt2-tiny", 2, 32), steps=2)
    u = m.as_unified()
    assert u.unified == max(m.timeline.bytes[Category.OPT]) > 0
    assert set(u.phases) == set(m.phases)
    for p in m.phases:
        assert u.phases[p][Category.OPT] == 0
        assert u.phases[p].total <= m.phases[p].total
    assert max(u.timeline.total) == u.peak.total  # the peak is the timeline's largest moment


def test_paging_under_a_budget():
    e = estimate("gpt2-tiny", 4, 64, paged_states=True)
    with_states = e.peak.total + e.unified
    assert paging(e, with_states).evicted == 0  # room for every state page
    over = with_states - e.unified // 2
    p = paging(e, over)  # half the states do not fit: whole pages go to host RAM
    assert p.fits and p.evicted % PAGE_SIZE == 0 and 0 < with_states - over <= p.evicted
    assert p.evicted < with_states - over + PAGE_SIZE
    assert not paging(e, e.peak.total - 1).fits  # the device peak alone is over: paging cannot help
    with pytest.raises(ValueError, match="paged_states=True"):
        paging(estimate("gpt2-tiny", 4, 64), with_states)


@pytest.mark.parametrize("kw, match", [
    (dict(optimizer="sgd-momentum", paged_states=True), "give optimizer 'adamw', 'adamw8bit', 'adam', "),
    (dict(optimizer="adafactor", paged_states=True), "paged optimizers"),
    (dict(optimizer="adamw", optimizer_offload="cpu", paged_states=True), "choose one"),
    (dict(paged_states=1), "True or False"),
])
def test_bad_paged_recipes_are_refused(kw, match):
    batch = kw.pop("batch", 1)
    with pytest.raises(ValueError, match=match):
        Recipe.of("gpt2-tiny", batch, 16, **kw)


def test_paged_states_under_fsdp2_are_refused_as_a_gap():
    """labkit's Zero pages its flat shards' states (tests/unit/test_cross_product.py measures it); FSDP2's
    DTensor shards (ZeRO-3 over LoRA) are not estimated paged yet, and the refusal says so."""
    from labkit.estimate.refusal import Kind, Refused

    with pytest.raises(Refused, match="paged_states under FSDP2") as e:
        estimate(Recipe.of("gpt2-tiny", 2, 16, dp=2, zero=3, lora_rank=4, paged_states=True))
    assert e.value.kind is Kind.NOT_ESTIMATED
    assert estimate(Recipe.of("gpt2-tiny", 2, 16, dp=2, zero=1, paged_states=True)).unified > 0


def test_the_cli_prints_the_states_apart_and_what_the_budget_pages(capsys):
    base = ["estimate", "--model", "gpt2-tiny", "--batch", "4", "--seq", "64", "--dtype", "fp32", "--paged"]
    e = estimate("gpt2-tiny", 4, 64, paged_states=True)
    budget = e.peak.total + e.unified // 2
    assert main(base + ["--json", "--budget", f"{budget}B"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["peak"] == e.peak.total and d["unified"] == e.unified and d["options"]["paged_states"]
    assert d["paging"] == {"paged_out": paging(e, budget).evicted, "fits": True}
    assert main(base + ["--budget", f"{budget}B"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "in CUDA unified memory" in out and "pages about" in out
    assert main(base[:-1] + ["--optimizer", "sgd", "--paged"]) == 2
    assert "--paged" in capsys.readouterr().err


def test_paged_states_on_pipeline_stages_print_their_unified_bytes(capsys):
    """Paged states on pipeline stages (measured: tests/distributed/test_layout_paged.py): the largest
    stage's states in unified memory, in the text and the JSON."""
    from labkit.estimate import estimate_ranks

    ranks = estimate_ranks(Recipe.of("gpt2-tiny", 4, 32, pp=2, micro_batch=2, schedule="1f1b", dtype="mixed-bf16",
                                     paged_states=True))  # the CLI's defaults
    top = max(ranks, key=lambda e: e.peak.total)
    base = ["estimate", "--model", "gpt2-tiny", "--batch", "4", "--seq", "32", "--pp", "2", "--micro-batch", "2",
            "--paged"]
    assert main(base + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unified"] == top.unified > 0
    assert main(base) == 0
    assert "paged optimizer states" in capsys.readouterr().out
