"""labkit.plan.peers: the published calculators reproduced exactly, checked against the installed tools."""

import pytest
import torch

from labkit.estimate import Recipe, estimate
from labkit.plan import peers
from labkit.plan.peers import (accelerate_shown, accelerate_training, compare, deepspeed_zero2, deepspeed_zero3,
                               fp32_bytes, zero_figure1)


@pytest.fixture(scope="module")
def bert_base_cased():
    """bert-base-cased as accelerate builds it: AutoModel (BertModel, pooler included) in fp32 on meta."""
    from transformers import AutoModel, BertConfig

    with torch.device("meta"):
        return AutoModel.from_config(BertConfig(vocab_size=28996))


def test_accelerate_docs_figures_for_bert_base_cased(bert_base_cased):
    """accelerate's docs: 413.18 MB of weights, 1.61 GB to train in float32, 826.36 MB in float16."""
    size = fp32_bytes(bert_base_cased)
    assert accelerate_shown(size) == "413.18 MB"
    assert accelerate_shown(accelerate_training(size, "float32")) == "1.61 GB"
    assert accelerate_shown(accelerate_training(size, "float16")) == "826.36 MB"


@pytest.mark.parity
def test_accelerate_parity_with_the_installed_estimator(bert_base_cased):
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes, convert_bytes

    total, _ = calculate_maximum_sizes(bert_base_cased)
    assert fp32_bytes(bert_base_cased) == total
    for dtype in ("float32", "float16", "bfloat16"):
        assert accelerate_training(total, dtype) == max(estimate_training_usage(total, dtype).values())
    for n in (total, 3 * total, 12345):
        assert accelerate_shown(n) == convert_bytes(n)


def test_zero_figure_1():
    """Rajbhandari et al. 2020, Figure 1: psi = 7.5B, N_d = 64, K = 12: 120, 31.4, 16.6 and 1.875 GB."""
    figs = zero_figure1(7.5e9, 64)
    assert [round(figs[s] / 1e9, 3) for s in range(4)] == [120.0, 31.406, 16.641, 1.875]
    assert [f"{figs[s] / 1e9:.3g}" for s in range(3)] == ["120", "31.4", "16.6"]


@pytest.mark.parity
@pytest.mark.parametrize("gpus, offload", [(1, False), (8, False), (8, True), (3, True)])
def test_deepspeed_parity_with_the_installed_functions(gpus, offload):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n, largest = 6_738_415_616, 131_072_000
    assert deepspeed_zero2(n, gpus, cpu_offload=offload) == \
        estimate_zero2_model_states_mem_needs(n, gpus, 1, cpu_offload=offload)
    host, gpu, _ = estimate_zero3_model_states_mem_needs(n, largest, gpus, 1, cpu_offload=offload,
                                                         cpu_offload_params=offload)
    assert deepspeed_zero3(n, largest, gpus, cpu_offload=offload) == (host, gpu)


def test_compare_puts_labkit_beside_each_peer_and_names_the_differences():
    r = Recipe("gpt2-tiny", 4, 64, dp=2, zero=0)
    c = compare(r)
    e = estimate(r)
    assert c.exact == e.peak.total and c.textbook == sum(t.bytes for t in e.textbook)
    tools = {row.tool for row in c.rows}
    assert tools == {peers.ACCELERATE, peers.ZERO_FIGURE, peers.DEEPSPEED.format(stage=2),
                     peers.DEEPSPEED.format(stage=3)}
    acc = next(row for row in c.rows if row.tool == peers.ACCELERATE)
    assert any("2**20" in d for d in acc.differences) and any("activations" in d for d in acc.differences)
    text = c.table()
    assert max(len(line) for line in text.splitlines()) <= 100
    with pytest.raises(ValueError, match="model name"):
        from labkit.models.gpt import GPTConfig

        compare(Recipe(GPTConfig(), 1, 8))
