"""Code decides on keys, people read names: no module of labkit decides on a term's `name` or a moment's
`where` (labkit.memory.report: Term.key, Moment.kind / block / variant are what code reads).

What is flagged, in every .py file under labkit/ (parsed with ast, nothing imported): a *display operand*,
`X.name` or `X.where`, or a string method or subscript on one (`X.name.lower()`, `X.where.split(" (")[0]`), used

- as an operand of a comparison: ==, !=, in, not in, is, is not (so `"block" in m.where` too);
- as the receiver of a string test: startswith, endswith, find, rfind, index, rindex, count, __contains__;
- as the text of re.search / re.match / re.fullmatch;
- as a key: of a dict comprehension or display (`{t.name: t}`), or of `.get(X.name)` / `mapping[X.name]`.

Formatting (f-strings, print, a table's cell) is not a decision and is not flagged. Sites whose receiver is
not a term or a moment (a Path, an ast node, a torch.device, ...) are listed in NOT_TERMS, by file, enclosing
function and receiver, each with what the receiver is; FORMATTING lists functions that may compare display
text because they only lay it out (none needs to today).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from labkit.estimate import Recipe, estimate
from labkit.memory.report import MomentKind, TermKey

LABKIT = Path(__file__).resolve().parents[2] / "labkit"
DISPLAY = ("name", "where")
STRING_TESTS = ("startswith", "endswith", "find", "rfind", "index", "rindex", "count", "__contains__")

# (file under labkit/, enclosing function, receiver): what the receiver is (not a term, not a moment)
FIELD, CATEGORY, AST = "a dataclasses.Field", "a Category member (its enum name)", "an ast node of a lesson's module"
NOT_TERMS = {
    ("cli/common.py", "parse_gpt_spec", "f"): FIELD,
    ("estimate/step_bytes.py", "<module>", "f"): FIELD,
    ("estimate/recipe.py", "options", "f"): FIELD,
    ("viz/lesson_panels.py", "_fixed", "f"): FIELD,
    ("memory/report.py", "as_dict", "c"): CATEGORY,
    ("peft/lisa.py", "lisa_memory_trace", "c"): CATEGORY,
    ("plan/matrix.py", "_category_max", "c"): CATEGORY,
    ("plan/matrix.py", "run_matrix", "c"): CATEGORY,
    ("course/stubs.py", "_defs", "n"): AST,
    ("course/stubs.py", "stub_source", "node"): AST,
    ("course/release.py", "lesson_notebooks", "p"): "a pathlib.Path: a notebook's file name",
    ("course/audit.py", "_calls", "p"): "an inspect.Parameter: a function's argument name",
    ("course/audit.py", "main", "p"): "a pathlib.Path: a notebook's file name",
    ("course/stubs.py", "seal_choices", "fn"): AST,
    ("plan/configs.py", "example_configs", "p"): "a pathlib.Path: a shipped config's file name",
    ("plan/waterfall.py", "naive", "f"): FIELD,
    ("cli/configs.py", "_waterfall", "k"): "a labkit.plan.waterfall.Knob (an Enum member's name, for JSON)",
    ("plan/search.py", "kind", "self.device"): "a torch.device",
    ("recompute/selective.py", "_is_random", "arg"): "a torch op schema's argument",
    ("session.py", "optional_import", "e"): "a ModuleNotFoundError's missing module",
    # the walk's tensors (labkit.estimate.walk.T) are named by the op that makes them; the summary table's
    # attention-score bytes still pick them by name until the walk records each tensor's role once
    # (issue 39, step 3: one record of ops)
}
# (file under labkit/, function): why it may compare display text (it only lays it out)
FORMATTING: dict[tuple[str, str], str] = {}


def _display(e: ast.AST) -> ast.Attribute | None:
    """The `X.name` / `X.where` an expression reads, through string methods and subscripts, or None."""
    if isinstance(e, ast.Attribute) and e.attr in DISPLAY:
        return e
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
        return _display(e.func.value)
    if isinstance(e, ast.Subscript):
        return _display(e.value)
    return None


def _decisions(node: ast.AST) -> list[ast.Attribute]:
    """The display operands `node` decides on (see the module docstring)."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        if f.attr in STRING_TESTS:
            operands = [f.value]
        elif f.attr == "get":
            operands = node.args[:1]
        elif f.attr in ("search", "match", "fullmatch") and isinstance(f.value, ast.Name) and f.value.id == "re":
            operands = node.args[1:2]
        else:
            operands = []
    elif isinstance(node, ast.DictComp):
        operands = [node.key]
    elif isinstance(node, ast.Dict):
        operands = [k for k in node.keys if k is not None]
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        operands = [node.slice]
    else:
        operands = []
    return [d for d in map(_display, operands) if d is not None]


def display_decisions(source: str, path: str = "<string>") -> list[tuple[str, str, str, int, str]]:
    """(path, enclosing function, receiver, line, code) of each decision on a display operand in `source`."""
    tree = ast.parse(source)
    out = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        for d in _decisions(node):
            out.append((path, func, ast.unparse(d.value), node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return out


def _sites() -> list[tuple[str, str, str, int, str]]:
    out = []
    for p in sorted(LABKIT.rglob("*.py")):
        out += display_decisions(p.read_text(), p.relative_to(LABKIT).as_posix())
    return out


def test_no_module_decides_on_a_term_name_or_a_moment_where():
    found = [s for s in _sites() if s[:3] not in NOT_TERMS and s[:2] not in FORMATTING]
    assert not found, "decide on Term.key / Moment.kind, block, variant, not on display text:\n" + "\n".join(
        f"  labkit/{path}:{line} in {func}(): {code}" for path, func, _, line, code in found)


def test_every_allowed_site_still_exists():
    """An entry of NOT_TERMS that no longer matches anything is dead: remove it (the list stays short)."""
    sites = {s[:3] for s in _sites()}
    assert not [k for k in NOT_TERMS if k not in sites]


@pytest.mark.parametrize("code", [
    't.name == "parameters"', '"finished block" in t.name', 'm.where.startswith(f"block {k} backward")',
    'm.where.endswith("reduce-scatter")', 't.name.lower() != "x"', 'x in m.where.split(" (")[0]',
    '{t.name: t for t in terms}', 'book.get(t.name)', 'table[m.where]', 're.search(r"block (\\d+)", m.where)',
    'text not in m.where', 'next(t for t in ts if t.name == NAME)',
])
def test_the_check_flags_a_decision_on_display_text(code):
    assert display_decisions(code)


@pytest.mark.parametrize("code", [
    'f"{t.name}: {m.where}"', 'print(t.name, m.where)', 'rows.append([t.name, t.formula])',
    't.key is TermKey.PARAMETERS', 'm.kind is MomentKind.BLOCK_BACKWARD and m.block == k',
    'label = m.where.split(" (")[0] + ", its steps"',
])
def test_the_check_leaves_formatting_alone(code):
    assert not display_decisions(code)


@pytest.mark.parametrize("recipe", [
    Recipe("gpt2-tiny", 2, 32, "mixed-bf16", "adamw"),
    Recipe("gpt2-tiny", 2, 32, "fp32", "adamw", checkpoint="full"),
    Recipe("gpt2-tiny", 4, 32, "fp32", "adamw", dp=2, zero=3),
], ids=["mixed", "checkpoint", "zero3"])
def test_every_term_has_a_key_and_every_moment_a_kind_agreeing_with_its_words(recipe):
    """The structured fields are set everywhere, and say what the words say (this test may read them)."""
    e = estimate(recipe)
    for m in e.moments:
        assert isinstance(m.kind, MomentKind), m.where
        hit = re.search(r"\bblock (\d+)", m.where)
        assert m.block == (int(hit.group(1)) if hit else None), (m.where, m.block)
        assert all(isinstance(t.key, TermKey) for t in m.terms), m.where
    assert all(isinstance(t.key, TermKey) for t in [*e.terms, *e.textbook])


def test_a_lesson_picks_a_term_by_its_key():
    """Estimate.term_bytes(key): what lessons 03 and 10 read instead of matching a term's name."""
    from labkit.models.gpt import GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64)
    manual = estimate(Recipe(GPTConfig(**{**vars(cfg), "attention": "manual"}), 2, 32))
    e = estimate(Recipe(cfg, 2, 32))
    scores = [t.bytes for t in manual.terms if t.key is TermKey.ATTENTION_SCORES]
    assert len(scores) == 1 and scores[0] > 0
    assert manual.term_bytes(TermKey.ATTENTION_SCORES) == scores[0]
    assert e.term_bytes(TermKey.ATTENTION_SCORES) < scores[0]  # sdpa on CPU saves no (S, S) scores
    assert e.term_bytes(TermKey.DEQUANT_SCRATCH) == 0  # no quantized base: no such term
    with pytest.raises(TypeError, match="TermKey"):
        e.term_bytes("attention scores (s^2)")


NOTEBOOKS = LABKIT.parent / "notebooks"
# (notebook, receiver): what the receiver is (not a term, not a moment)
NOTEBOOK_NOT_TERMS: dict[tuple[str, str], str] = {}


def _cell_code(source: str) -> str:
    """A code cell as Python: IPython's magics and shell lines (% and !) become `pass`."""
    return "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def test_no_lesson_decides_on_a_term_name_or_a_moment_where():
    """The lessons too: a cell that picks a moment by its `where` breaks when the words change."""
    import nbformat

    found = []
    for p in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(p, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                for s in display_decisions(_cell_code(cell.source), f"{p.name} cell {i}"):
                    if (p.name, s[2]) not in NOTEBOOK_NOT_TERMS:
                        found.append(s)
    assert not found, "decide on Term.key / Moment.key, not on display text:\n" + "\n".join(
        f"  {path}:{line}: {code}" for path, _, _, line, code in found)
