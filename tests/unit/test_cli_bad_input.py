"""`python -m labkit estimate` and `wall` with bad input: exit status 2, one line on stderr that names the
offending option or value, no traceback, nothing on stdout. Huge inputs are refused by rule (labkit.cli's
bounds), before any model is built; a handful of good inputs, bounds included, still answer.

Everything runs in-process (labkit.cli.main), offline."""

import json

import pytest
import torch

import labkit.cli as cli
from labkit.cli import MAX_LAYERS, MAX_SIZE, MAX_WALL_LAYERS, main
from labkit.estimate.spec import spec_from
from labkit.models import hf


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an unknown "org/name" fails at once instead of going online


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    """A folder of local transformers configs, good and bad (what --model PATH reads)."""
    d = tmp_path_factory.mktemp("configs")
    g, l = hf.get_config("gpt2-tiny").to_dict(), hf.get_config("llama-tiny").to_dict()
    configs = {
        "g_ok": g, "l_ok": l, "bert": {"model_type": "bert"}, "no_type": {"hidden_size": 64},
        "g_layers_huge": dict(g, n_layer=10**7), "g_embd_zero": dict(g, n_embd=0),
        "g_embd_huge": dict(g, n_embd=10**9, n_head=1), "g_head_nodiv": dict(g, n_head=3),
        "g_embd_float": dict(g, n_embd=64.5), "g_embd_str": dict(g, n_embd="64"), "g_vocab_neg": dict(g, vocab_size=-5),
        "g_inner_neg": dict(g, n_inner=-1), "g_act": dict(g, activation_function="nope"),
        "g_drop": dict(g, attn_pdrop=float("nan")), "l_kv_nodiv": dict(l, num_key_value_heads=3),
        "l_hidden_nodiv": dict(l, hidden_size=66), "l_act": dict(l, hidden_act="nope"),
        "l_ffn_zero": dict(l, intermediate_size=0), "l_layers_bool": dict(l, num_hidden_layers=True),
        "l_positions_huge": dict(l, max_position_embeddings=2**40),
    }
    for name, c in configs.items():
        (d / f"{name}.json").write_text(json.dumps(c))
    (d / "broken.json").write_text("{not json")
    (d / "binary.json").write_bytes(b"\xff\xfe\x00")
    (d / "empty_dir").mkdir()
    return d


def run(capsys, argv, cfg=None):
    argv = [a.format(cfg=cfg) for a in argv]
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own exits (none expected: they are turned into status 2)
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


E = ["estimate", "--model", "gpt2-tiny", "--seq", "8"]  # gpt2-tiny: 2 layers, h 64, 128 positions
G = ["estimate", "--model", "gpt:n_layer=4,n_embd=64,block_size=64", "--seq", "8"]
W = ["wall", "--models", "gpt2-tiny", "--seq", "8"]
BIG = str(2**63)

# (argv, words the one line must contain: the option and/or the value that is wrong)
BAD = [
    # ---- estimate: numbers
    (E + ["--batch", "0"], ["--batch", "0"]),
    (E + ["--batch", "-1"], ["--batch", "-1"]),
    (E + ["--batch", "1.5"], ["--batch", "1.5"]),
    (E + ["--batch", "1e30"], ["--batch", "1e30"]),
    (E + ["--batch", "nan"], ["--batch", "nan"]),
    (E + ["--batch", "inf"], ["--batch", "inf"]),
    (E + ["--batch", BIG], ["--batch", BIG, "2**63"]),
    (E + ["--batch", "1_000"], ["--batch", "1_000"]),
    (E + ["--batch", "\u0663"], ["--batch", "\u0663"]),  # an Arabic-Indic 3: int() would take it
    (E + ["--batch", ""], ["--batch"]),
    (E + ["--batch", str(2**62)], ["--batch " + str(2**62), "2**64"]),  # a peak no 64-bit machine addresses
    (E + ["--seq", "0"], ["--seq", "0"]),
    (E + ["--seq", "-4"], ["--seq", "-4"]),
    (E + ["--seq", "abc"], ["--seq", "abc"]),
    (E + ["--seq", "129"], ["--seq 129", "128 positions"]),
    (E + ["--seq", "9" * 25], ["--seq", "2**63"]),
    (E + ["--seq", "9" * 5000], ["--seq"]),  # beyond Python's int() digit limit
    (G + ["--checkpoint", "full", "--segments", "0"], ["--segments", "0"]),
    (G + ["--segments", "3"], ["--segments 3", "--checkpoint full"]),
    (G + ["--checkpoint", "sqrt", "--segments", "2"], ["--segments 2", "sqrt"]),
    (G + ["--checkpoint", "full", "--segments", "5"], ["--segments", "5"]),
    (E + ["--micro-batch", "0"], ["--micro-batch", "0"]),
    (E + ["--batch", "4", "--micro-batch", "3"], ["--micro-batch 3", "--batch 4"]),
    (E + ["--batch", "4", "--micro-batch", "8"], ["--micro-batch 8", "--batch 4"]),
    (E + ["--accumulate", "0"], ["--accumulate", "0"]),
    (E + ["--batch", "4", "--accumulate", "3"], ["--accumulate 3", "--batch 4"]),
    (E + ["--batch", "4", "--accumulate", "2", "--micro-batch", "2"], ["--micro-batch", "--accumulate"]),
    # ---- estimate: options that mean something only with another, or that the estimator refuses
    (E + ["--rank", "4"], ["--rank 4", "galore"]),
    (E + ["--optimizer", "galore"], ["--optimizer galore", "--rank"]),
    (E + ["--optimizer", "galore8bit", "--rank", "0"], ["--rank", "0"]),
    (E + ["--optimizer", "galore", "--rank", "65"], ["--rank 65", "GaLore"]),
    (E + ["--proj-dtype", "int8"], ["--proj-dtype int8", "--optimizer galore8bit"]),
    (E + ["--optimizer", "galore", "--rank", "4", "--proj-dtype", "fp32"], ["--proj-dtype fp32", "galore8bit"]),
    (E + ["--optimizer", "galore8bit", "--rank", "4", "--proj-dtype", "int4"], ["--proj-dtype", "int4"]),
    (E + ["--optimizer", "galore8bit", "--proj-dtype", "int8"], ["--optimizer galore8bit", "--rank"]),
    (E + ["--lora-rank", "0"], ["--lora-rank", "0"]),
    (E + ["--lora-rank", "65"], ["--lora-rank 65", "(64)"]),
    (["estimate", "--model", "llama-tiny", "--seq", "8", "--lora-rank", "33"], ["--lora-rank 33", "(32)"]),
    (E + ["--lora-rank", "1e3"], ["--lora-rank", "1e3"]),
    (E + ["--lora-targets", "c_attn"], ["--lora-targets", "c_attn", "--lora-rank"]),
    (E + ["--lora-targets", "all-linear"], ["--lora-targets", "--lora-rank"]),
    (E + ["--lora-targets", ""], ["--lora-targets", "--lora-rank"]),
    (E + ["--lora-rank", "4", "--lora-targets", ""], ["--lora-targets"]),
    (E + ["--lora-rank", "4", "--lora-targets", ","], ["--lora-targets"]),
    (E + ["--lora-rank", "4", "--lora-targets", "q_proj"], ["q_proj", "c_attn"]),
    (E + ["--quant", "nf4"], ["--quant nf4", "--lora-rank"]),
    (E + ["--quant", "int8"], ["--quant int8", "--lora-rank"]),
    (E + ["--quant", "fp4", "--lora-rank", "4"], ["--quant", "fp4"]),
    (E + ["--lisa-layers", "0"], ["--lisa-layers", "0"]),
    (E + ["--lisa-layers", "3"], ["--lisa-layers", "3"]),
    (E + ["--lisa-layers", "1", "--lora-rank", "4"], ["--lisa-layers", "--lora-rank"]),
    (E + ["--lora-rank", "4", "--optimizer", "galore", "--rank", "2"], ["--lora-rank", "GaLore"]),
    (E + ["--lisa-layers", "1", "--step-in-backward"], ["--lisa-layers", "--step-in-backward"]),
    (E + ["--optimizer", "sgd", "--optimizer-offload", "cpu"], ["--optimizer-offload", "sgd"]),
    (E + ["--optimizer-offload", "tape"], ["--optimizer-offload", "tape"]),
    (E + ["--step-in-backward", "--optimizer-offload", "cpu"], ["--step-in-backward", "--optimizer-offload"]),
    (E + ["--batch", "4", "--accumulate", "2", "--step-in-backward"], ["--step-in-backward", "micro-batches"]),
    (E + ["--checkpoint", "sometimes"], ["--checkpoint", "sometimes"]),
    (E + ["--dtype", "fp8"], ["--dtype", "fp8"]),
    (E + ["--dtype", ""], ["--dtype"]),
    (E + ["--optimizer", "adagrad"], ["--optimizer", "adagrad"]),
    (E + ["--device", "tpu"], ["--device", "tpu"]),
    (E + ["--bogus"], ["--bogus"]),
    (E + ["extra"], ["extra"]),
    (["estimate", "--seq", "8"], ["--model"]),
    (E + ["--json", "--batch", "0"], ["--batch", "0"]),
    (E + ["--json", "--lora-targets", "c_attn"], ["--lora-targets", "--lora-rank"]),
    # ---- estimate: models by name or path
    (["estimate", "--model", "", "--seq", "8"], ["''"]),
    (["estimate", "--model", "GPT2", "--seq", "8"], ["'GPT2'"]),
    (["estimate", "--model", "no-such-org/no-such-model", "--seq", "8"], ["no-such-org/no-such-model"]),
    (["estimate", "--model", "{cfg}/missing.json", "--seq", "8"], ["missing.json"]),
    (["estimate", "--model", "{cfg}/empty_dir", "--seq", "8"], ["empty_dir"]),
    (["estimate", "--model", "{cfg}/broken.json", "--seq", "8"], ["broken.json"]),
    (["estimate", "--model", "{cfg}/binary.json", "--seq", "8"], ["binary.json"]),
    (["estimate", "--model", "{cfg}/no_type.json", "--seq", "8"], ["no_type.json", "model_type"]),
    (["estimate", "--model", "{cfg}/bert.json", "--seq", "8"], ["'bert'"]),
    (["estimate", "--model", "{cfg}/g_layers_huge.json", "--seq", "8"], ["n_layer=10000000", str(MAX_LAYERS)]),
    (["estimate", "--model", "{cfg}/g_embd_zero.json", "--seq", "8"], ["n_embd", "0"]),
    (["estimate", "--model", "{cfg}/g_embd_huge.json", "--seq", "8"], ["n_embd=1000000000", "2**24"]),
    (["estimate", "--model", "{cfg}/g_head_nodiv.json", "--seq", "8"], ["n_head", "3"]),
    (["estimate", "--model", "{cfg}/g_embd_float.json", "--seq", "8"], ["n_embd", "64.5"]),
    (["estimate", "--model", "{cfg}/g_embd_str.json", "--seq", "8"], ["n_embd", "'64'"]),
    (["estimate", "--model", "{cfg}/g_vocab_neg.json", "--seq", "8"], ["vocab_size", "-5"]),
    (["estimate", "--model", "{cfg}/g_inner_neg.json", "--seq", "8"], ["n_inner", "-1"]),
    (["estimate", "--model", "{cfg}/g_act.json", "--seq", "8"], ["g_act.json", "nope"]),
    (["estimate", "--model", "{cfg}/g_drop.json", "--seq", "8"], ["attn_pdrop", "nan"]),
    (["estimate", "--model", "{cfg}/l_kv_nodiv.json", "--seq", "8"], ["num_key_value_heads", "3"]),
    (["estimate", "--model", "{cfg}/l_hidden_nodiv.json", "--seq", "8"], ["l_hidden_nodiv.json", "66"]),
    (["estimate", "--model", "{cfg}/l_act.json", "--seq", "8"], ["l_act.json", "nope"]),
    (["estimate", "--model", "{cfg}/l_ffn_zero.json", "--seq", "8"], ["intermediate_size", "0"]),
    (["estimate", "--model", "{cfg}/l_layers_bool.json", "--seq", "8"], ["num_hidden_layers", "True"]),
    (["estimate", "--model", "{cfg}/l_positions_huge.json", "--seq", "8"], ["max_position_embeddings", "2**24"]),
    # ---- estimate: gpt:KEY=VAL configs
    (["estimate", "--model", "gpt:n_layer=0", "--seq", "8"], ["n_layer", "0"]),
    (["estimate", "--model", "gpt:n_layer=-1", "--seq", "8"], ["n_layer", "-1"]),
    (["estimate", "--model", f"gpt:n_layer={MAX_LAYERS + 1}", "--seq", "8"], [f"n_layer={MAX_LAYERS + 1}"]),
    (["estimate", "--model", "gpt:n_layer=10000000", "--seq", "8"], ["n_layer=10000000", str(MAX_LAYERS)]),
    (["estimate", "--model", "gpt:n_layer=1.5", "--seq", "8"], ["n_layer", "1.5"]),
    (["estimate", "--model", "gpt:n_layer=1e3", "--seq", "8"], ["n_layer", "1e3"]),
    (["estimate", "--model", "gpt:n_layer=1_000", "--seq", "8"], ["n_layer", "1_000"]),
    (["estimate", "--model", "gpt:n_layer=two", "--seq", "8"], ["n_layer", "two"]),
    (["estimate", "--model", "gpt:vocab_size=0", "--seq", "8"], ["vocab_size", "0"]),
    (["estimate", "--model", "gpt:n_embd=100,n_head=3", "--seq", "8"], ["n_embd", "n_head"]),
    (["estimate", "--model", "gpt:n_embd=1000000000", "--seq", "8"], ["n_embd=1000000000"]),
    (["estimate", "--model", f"gpt:n_embd={MAX_SIZE * 2},n_head=1", "--seq", "8"], [f"n_embd={MAX_SIZE * 2}"]),
    (["estimate", "--model", "gpt:vocab_size=" + "9" * 20, "--seq", "8"], ["vocab_size", "9" * 20]),
    (["estimate", "--model", "gpt:block_size=" + BIG, "--seq", "8"], ["block_size", BIG]),
    (["estimate", "--model", "gpt:dropout=nan", "--seq", "8"], ["dropout", "nan"]),
    (["estimate", "--model", "gpt:dropout=inf", "--seq", "8"], ["dropout", "inf"]),
    (["estimate", "--model", "gpt:dropout=1", "--seq", "8"], ["dropout", "1.0"]),
    (["estimate", "--model", "gpt:dropout=-0.1", "--seq", "8"], ["dropout", "-0.1"]),
    (["estimate", "--model", "gpt:bias=maybe", "--seq", "8"], ["bias", "maybe"]),
    (["estimate", "--model", "gpt:attention=flash", "--seq", "8"], ["attention", "flash"]),
    (["estimate", "--model", "gpt:depth=3", "--seq", "8"], ["depth"]),
    (["estimate", "--model", "gpt:n_layer", "--seq", "8"], ["n_layer", "KEY=VAL"]),
    (["estimate", "--model", "gpt:", "--seq", "8"], ["'gpt:'", "KEY=VAL"]),
    (["estimate", "--model", "gpt:,", "--seq", "8"], ["'gpt:,'"]),
    (["estimate", "--model", "gpt:n_layer=2,", "--seq", "8"], ["'gpt:n_layer=2,'"]),
    (["estimate", "--model", "gpt:=3", "--seq", "8"], ["'=3'"]),
    (["estimate", "--model", "gpt:n_layer=2,n_layer=3", "--seq", "8"], ["n_layer", "twice"]),
    (["estimate", "--model", "gpt:block_size=64", "--seq", "65"], ["--seq 65", "64 positions"]),
    # ---- wall
    (W + ["--budgets", ""], ["--budgets", "''"]),
    (W + ["--budgets", ","], ["--budgets", "','"]),
    (W + ["--budgets", "16,,24"], ["--budgets", "16,,24"]),
    (W + ["--budgets", "nan"], ["--budgets", "nan"]),
    (W + ["--budgets", "inf"], ["--budgets", "inf"]),
    (W + ["--budgets", "-1"], ["--budgets", "-1"]),
    (W + ["--budgets", "0"], ["--budgets", "'0'"]),
    (W + ["--budgets", "1e400"], ["--budgets", "1e400"]),
    (W + ["--budgets", "1e-300"], ["--budgets", "1e-300"]),
    (W + ["--budgets", "1e11"], ["--budgets", "1e11"]),
    (W + ["--budgets", "abc"], ["--budgets", "abc"]),
    (W + ["--budgets", "0x10"], ["--budgets", "0x10"]),
    (W + ["--budgets", "16GiB,16GiB"], ["--budgets", "16", "twice"]),
    (W + ["--budgets", "16GiB,16.0GiB"], ["--budgets", "twice"]),
    (W + ["--budgets", "24"], ["--budgets", "give a unit: 24GB or 24GiB"]),
    (W + ["--budgets", "-24GB"], ["--budgets", "must be positive", "-24GB"]),
    (W + ["--budgets", "-1GiB,2GiB"], ["--budgets", "must be positive"]),
    (W + ["--methods", ","], ["--methods", "','"]),
    (W + ["--headroom", "100"], ["--headroom", "100"]),
    # ---- sizes: one rule for every memory option (a unit required, a positive size)
    (E + ["--budget", "24"], ["--budget", "give a unit: 24GB or 24GiB"]),
    (E + ["--budget", "-24GB"], ["--budget", "must be positive", "-24GB"]),
    (E + ["--budget=-24GB"], ["--budget", "must be positive"]),
    (E + ["--budget", "24XB"], ["--budget", "24XB"]),
    (E + ["--budget", "24GB", "--headroom", "-1"], ["--headroom", "-1"]),
    (["plan", "--model", "gpt2-tiny", "--memory", "24"], ["--memory", "give a unit: 24GB or 24GiB"]),
    (["plan", "--model", "gpt2-tiny", "--memory", "-24GB"], ["--memory", "must be positive", "-24GB"]),
    (["plan", "--model", "gpt2-tiny", "--memory", "-.5GiB"], ["--memory", "must be positive"]),
    (["plan", "--model", "gpt2-tiny", "--memory", "0GB"], ["--memory", "positive"]),
    (W + ["--methods", ""], ["--methods", "''"]),
    (W + ["--methods", "full,"], ["--methods", "full,"]),
    (W + ["--methods", "foo"], ["--methods", "foo"]),
    (W + ["--methods", "full,full"], ["--methods", "full", "twice"]),
    (["wall", "--models", "", "--seq", "8"], ["--models", "''"]),
    (["wall", "--models", ",", "--seq", "8"], ["--models", "','"]),
    (["wall", "--models", "gpt2-tiny,,llama-tiny", "--seq", "8"], ["--models", "gpt2-tiny,,llama-tiny"]),
    (["wall", "--models", "foo", "--seq", "8"], ["'foo'"]),
    (["wall", "--models", "gpt2-tiny,gpt2-tiny", "--seq", "8"], ["--models", "gpt2-tiny", "twice"]),
    (["wall", "--models", "gpt:n_layer=0", "--seq", "8"], ["n_layer", "0"]),
    (["wall", "--models", f"gpt:n_layer={MAX_LAYERS},gpt:n_layer={MAX_LAYERS},n_embd=64,gpt:n_layer=2,n_embd=32",
      "--seq", "8"], ["--models", str(2 * MAX_LAYERS + 2), str(MAX_WALL_LAYERS)]),
    (["wall", "--models", "{cfg}/g_layers_huge.json", "--seq", "8"], ["n_layer=10000000"]),
    (W + ["--lora-rank", "0"], ["--lora-rank", "0"]),
    (W + ["--lora-rank", "65"], ["gpt2-tiny", "--lora-rank 65"]),
    (W + ["--lora-rank", "4", "--methods", "full"], ["--lora-rank 4", "full"]),
    (W + ["--dtype", "fp32", "--methods", "lora", "--adapters", "fp32"], ["--adapters fp32", "mixed-bf16"]),
    (W + ["--optimizer", "galore"], ["--optimizer galore", "rank"]),
    (W + ["--optimizer", "galore8bit"], ["--optimizer galore8bit", "rank"]),
    (W + ["--optimizer", "foo"], ["--optimizer", "foo"]),
    (["wall", "--models", "gpt2-tiny", "--seq", "129"], ["gpt2-tiny", "--seq 129"]),
    (W + ["--batch", "0"], ["--batch", "0"]),
    (W + ["--batch", "1e3"], ["--batch", "1e3"]),
    (W + ["--batch", BIG], ["--batch", BIG]),
    (W + ["--batch", str(2**62)], ["gpt2-tiny", "--batch " + str(2**62), "2**64"]),
    (W + ["--dtype", "fp8"], ["--dtype", "fp8"]),
    (W + ["--device", "tpu"], ["--device", "tpu"]),
    (W + ["--segments", "2"], ["--segments"]),
    (W + ["--json", "--budgets", "nan"], ["--budgets", "nan"]),
    # ---- no command
    ([], ["command"]),
    (["train"], ["train"]),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a)[:80] for a, _ in BAD])
def test_bad_input_is_one_line_naming_it_and_status_2(capsys, cfg, argv, words):
    code, out, err = run(capsys, argv, cfg)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err  # exactly one line
    assert "Traceback" not in err and err.startswith("labkit"), err
    for w in words:
        assert w in err, (w, err)


def test_the_table_is_long_and_covers_both_commands():
    assert len(BAD) >= 80
    assert sum(a[:1] == ["wall"] for a, _ in BAD) >= 30 and sum(a[:1] == ["estimate"] for a, _ in BAD) >= 80


GOOD = [
    E + ["--json"],
    ["estimate", "--model", "gpt", "--seq", "8"],  # GPTConfig's defaults
    ["estimate", "--model", f"gpt:n_layer={MAX_LAYERS}", "--seq", "8"],  # the layer bound itself
    ["estimate", "--model", f"gpt:n_embd={MAX_SIZE},n_head=1,n_layer=1,vocab_size=256", "--seq", "8"],  # width bound
    ["estimate", "--model", "gpt:n_layer=4,n_embd=64,block_size=64", "--batch", "8", "--seq", "64",
     "--checkpoint", "full", "--segments", "2", "--accumulate", "2"],
    ["estimate", "--model", "llama-tiny", "--seq", "8", "--lora-rank", "32"],  # a rank equal to the smaller side
    E + ["--optimizer", "galore", "--rank", "64"],
    E + ["--optimizer", "galore8bit", "--rank", "8", "--proj-dtype", "int8", "--step-in-backward"],
    E + ["--optimizer", "galore8bit", "--rank", "8", "--proj-dtype", "param", "--json"],
    E + ["--quant", "none", "--checkpoint", "none"],  # explicit defaults
    E + ["--checkpoint", "full"],  # checkpointing and offload cover transformers' models and adapters too
    ["estimate", "--model", "llama-tiny", "--seq", "8", "--offload-activations"],
    G + ["--lora-rank", "4", "--checkpoint", "selective"],
    ["estimate", "--model", "llama-tiny", "--seq", "8", "--lora-rank", "4", "--quant", "nf4", "--checkpoint", "full"],
    E + ["--batch", "4", "--micro-batch", "4", "--step-in-backward"],
    E + ["--lora-rank", "4", "--step-in-backward"],  # each adapter steps as its gradient is ready
    E + ["--batch", "1000000"],
    ["estimate", "--model", "{cfg}/g_ok.json", "--seq", "8"],
    ["estimate", "--model", "{cfg}/l_ok.json", "--seq", "8", "--lora-rank", "8", "--quant", "nf4"],
    ["wall", "--models", "gpt2-tiny,gpt:n_layer=2,n_embd=64,llama-tiny", "--seq", "8", "--budgets", "0.5GiB,24GB"],
    W + ["--methods", "lora", "--lora-rank", "8"],
    W + ["--budgets", f"1B,{2**34}GiB"],  # one byte and 2**64 bytes
    W + ["--budgets", "24GB"],
    E + ["--budget", "24GB", "--headroom", "0"],
    ["wall", "--json"],  # every non-tiny preset
]


@pytest.mark.parametrize("argv", GOOD, ids=[" ".join(a)[:80] for a in GOOD])
def test_good_input_answers(capsys, cfg, argv):
    code, out, err = run(capsys, argv, cfg)
    assert code == 0 and err == "" and out
    if "--json" in argv:
        json.loads(out)


def test_wall_keeps_a_gpt_spec_with_commas_as_one_model(capsys):
    code, out, _ = run(capsys, ["wall", "--models", "gpt2-tiny,gpt:n_layer=2,n_embd=64", "--seq", "8",
                                "--methods", "full", "--json"])
    assert code == 0
    assert [r["model"] for r in json.loads(out)["rows"]] == ["gpt2-tiny", "gpt:n_layer=2,n_embd=64"]


def test_huge_models_are_refused_before_anything_is_built(capsys, cfg, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr("labkit.estimate.spec.spec_from", no_build)
    for model in ("gpt:n_layer=10000000", f"gpt:n_layer={MAX_LAYERS + 1}", "{cfg}/g_layers_huge.json",
                  "{cfg}/g_embd_huge.json", f"gpt:vocab_size={MAX_SIZE + 1}"):
        code, _, err = run(capsys, ["estimate", "--model", model, "--seq", "8"], cfg)
        assert code == 2 and err.count("\n") == 1, err
    code, _, err = run(capsys, ["wall", "--models", ",".join(f"gpt:n_layer={MAX_LAYERS},n_embd={64 * (i + 1)}"
                                                             for i in range(3)), "--seq", "8"], cfg)
    assert code == 2 and str(MAX_WALL_LAYERS) in err


def test_shapes_only_read_gives_the_same_spec_and_restores_torch_init():
    normal = torch.nn.init.normal_
    for name in ("gpt2-tiny", "llama-tiny", "gpt2", "gpt:n_layer=3,n_embd=64,bias=false"):
        model, layers = cli.check_model(name)
        spec = cli.read_model(model, name)
        assert spec == spec_from(model) and spec.n_layer == layers
    assert torch.nn.init.normal_ is normal
