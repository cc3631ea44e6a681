"""What the tables print stays readable: the text form of `explain()`, of a moment's terms, of the summary tables
(`breakdown_table`, the CLI's estimate, per-rank and wall tables) keeps every line within 120 columns, so a
notebook never wraps one mid-word, and in Jupyter the same objects show as HTML tables."""

import re
from html.parser import HTMLParser

import pytest

from labkit.cli import main
from labkit.estimate import Recipe, estimate
from labkit.estimate.zero_terms import stages
from labkit.memory.table import WIDTH, Report, Table
from labkit.viz.tables import breakdown_table

RECIPES = {  # a plain step, a checkpointed 65B QLoRA (the widest terms: NF4 and the recompute's), LoRA + GaLore
    "gpt2 mixed-bf16": Recipe("gpt2", 4, 256, "mixed-bf16", "adamw"),
    "llama-65b qlora": Recipe("llama-65b", 16, 512, "bf16", "adamw", lora_rank=64, quant="nf4", micro_batch=4,
                              checkpoint="full", device="cuda"),
    "llama-tiny lora galore": Recipe("llama-tiny", 2, 32, "fp32", "galore", rank=4, checkpoint="selective"),
}


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)


def html_tags(html: str) -> list[str]:
    p = _Tags()
    p.feed(html)
    return p.tags


def assert_readable(obj, what: str):
    """Text within WIDTH columns; HTML that is a table (with a header row and a row per line of data)."""
    assert widest(str(obj)) <= WIDTH, f"{what}: a line of {widest(str(obj))} columns:\n{obj}"
    tags = html_tags(obj._repr_html_())
    assert "table" in tags and "th" in tags and "td" in tags, f"{what}: its HTML is not a table: {tags}"


@pytest.fixture(scope="module", params=sorted(RECIPES))
def est(request):
    return request.param, estimate(RECIPES[request.param])


def test_explain_and_the_breakdown_table_fit_120_columns_and_show_as_html(est):
    name, e = est
    text = e.explain()
    assert isinstance(text, Report) and isinstance(text, str)
    assert_readable(text, f"{name}: explain()")
    assert_readable(e.explain("forward"), f"{name}: explain('forward')")
    assert_readable(e.peak_moment.explain(), f"{name}: the peak moment's explain()")
    assert_readable(breakdown_table(e), f"{name}: breakdown_table")
    # every term of the peak is a row of the HTML form, its text escaped once
    html = text._repr_html_()
    assert html.count("<table>") == sum(isinstance(b, Table) for b in text.blocks) == 3
    last = text.blocks[-1]
    assert isinstance(last, Table) and len(last.rows) == len([t for t in e.peak_moment.terms if t.bytes])
    assert html.count("<tr>") >= sum(len(b.rows) + 1 for b in text.blocks if isinstance(b, Table))


def test_zero_layout_explain_fits():
    for stage, e in stages(Recipe("gpt2", 8, 256, "mixed-bf16", "adamw", dp=2)).items():
        assert_readable(e.explain(), f"ZeRO-{stage} explain()")


@pytest.mark.parametrize("argv", [
    ["estimate", "--model", "llama-65b", "--batch", "16", "--micro-batch", "4", "--seq", "512", "--dtype", "bf16",
     "--lora-rank", "64", "--quant", "nf4", "--checkpoint", "full", "--device", "cuda"],
    ["estimate", "--model", "gpt2", "--batch", "8", "--seq", "256", "--dp", "2", "--zero", "3"],
    ["estimate", "--model", "gpt:n_layer=4,n_embd=128,block_size=128", "--batch", "8", "--seq", "128", "--tp", "2",
     "--pp", "2"],
    ["wall", "--methods", "full,lora,qlora"],
    ["plan", "--model", "gpt2-tiny", "--memory", "2MiB", "--device-preset", "cpu", "--top", "2"],
], ids=["qlora", "zero3", "tp-pp", "wall", "plan"])
def test_cli_tables_fit_120_columns(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    if argv[0] == "plan":  # its last line is the shell command that exports plan 1: one line, to copy whole
        out = out.rstrip().rsplit("\n", 1)[0]
    assert widest(out) <= WIDTH, "\n".join(line for line in out.splitlines() if len(line) > WIDTH)


def test_a_long_cell_wraps_at_its_words_inside_its_column():
    long = "a formula with many words " * 8
    t = Table(["bytes", "term", "formula"], [["1.00 KiB", "short", long.strip()]], right={0})
    lines = t.text().splitlines()
    assert widest(t.text()) <= WIDTH and len(lines) > 3
    col = lines[0].index("formula")
    wrapped = [line[col:] for line in lines[2:]]
    assert " ".join(w.strip() for w in wrapped) == long.strip()  # nothing lost, no word cut
    assert all(re.fullmatch(r"[a-z ]+", w) for w in wrapped)
    assert lines[2].startswith("1.00 KiB") and not lines[3][:col].strip()  # the other cells on its first line
    assert "&lt;b&gt;" in Table(["x"], [["<b>"]])._repr_html_()  # cells are text, escaped
