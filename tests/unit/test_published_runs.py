"""bench/published_runs.py's rows: each names a source a reader can open, its unit and what it
measures, and labkit's recipe for every modelled row constructs. The prediction's distance from the
published figure is the bench's to print, not asserted here."""

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("published_runs",
                                                  ROOT / "bench" / "published_runs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["published_runs"] = mod  # its dataclasses look their module up while made
    spec.loader.exec_module(mod)
    return mod


def test_every_row_names_source_unit_and_measure(bench):
    assert 6 <= len(bench.ROWS) <= 12
    keys = [r.key for r in bench.ROWS]
    assert len(set(keys)) == len(keys)
    for row in bench.ROWS:
        assert re.search(r"https://\S+", row.source), row.key
        assert row.unit in bench.UNITS, row.key
        assert isinstance(row.measures, bench.Measure), row.key
        assert row.how_known.strip() and row.setup.strip() and row.not_modelled.strip(), row.key
        assert row.figure > 0, row.key


def test_modelled_recipes_construct_on_cuda(bench):
    from labkit.estimate import Recipe

    modelled = [row for row in bench.ROWS if row.recipe is not None]
    assert modelled and len(modelled) < len(bench.ROWS)  # a not-modelled row is kept, with reason
    for row in modelled:
        recipe = bench.recipe_of(row)
        assert isinstance(recipe, Recipe) and recipe.device == "cuda", row.key
    for row in bench.ROWS:
        if row.recipe is None:
            assert bench.recipe_of(row) is None


def test_named_allocation_is_derived_from_the_setup(bench):
    """bnb.nf4's named bytes: bf16 minus NF4 (no double quantization) over the Linears labkit keeps
    in bf16: under the default quant_set ("all-linear", transformers + bitsandbytes') the head
    alone; under "targets" (torchtune's) every Linear outside the LoRA targets; none when all are
    quantized."""
    from labkit.estimate import Recipe, spec_from
    from labkit.quant.nf4 import nf4_bytes_for

    r = Recipe(model="llama-tiny", batch=1, seq=8, dtype="bf16", lora_rank=4,
               lora_targets="q_proj,v_proj", quant="nf4", device="cuda")
    spec = spec_from(r.model, **r.config)
    head = [d_in * d_out for name, d_in, d_out, _ in spec.linears if name.endswith("lm_head")]
    assert len(head) == 1
    want = 2 * head[0] - nf4_bytes_for(head[0], double_quant=False)
    assert bench.bnb_every_linear_bytes(r) == want
    others = [d_in * d_out for name, d_in, d_out, _ in spec.linears
              if name.rsplit(".", 1)[-1] not in ("q_proj", "v_proj")]
    assert len(others) > 1
    want = sum(2 * n - nf4_bytes_for(n, double_quant=False) for n in others)
    assert bench.bnb_every_linear_bytes(dataclasses.replace(r, quant_set="targets")) == want
    every = ",".join(sorted({name.rsplit(".", 1)[-1] for name, *_ in spec.linears}))
    assert bench.bnb_every_linear_bytes(dataclasses.replace(r, lora_targets=every)) == 0
