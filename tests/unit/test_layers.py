"""The layers import downwards only: memory <- techniques <- estimate <- run <- viz, exercises, cli, plan.

Two checks: every `import` statement in labkit (module level or inside a function) names a layer at or
below its own; and importing each layer in a fresh interpreter loads nothing from the layers above it.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

import labkit

ROOT = pathlib.Path(labkit.__file__).parent
TECHNIQUES = {"models", "data", "precision", "recompute", "optim", "quant", "peft", "accumulate", "device", "paths",
              "distributed"}
LAYER = {"session": 4, "memory": 0, **{t: 1 for t in TECHNIQUES}, "estimate": 2, "run": 3,
         "viz": 4, "exercises": 4, "cli": 4, "colab": 4, "plan": 4, "course": 5, "__main__": 5, "__init__": 0}


def _layer_of(module: str) -> int:
    """labkit.memory.ledger -> 0; labkit.run -> 3."""
    parts = module.split(".")
    return LAYER[parts[1]] if len(parts) > 1 else 0


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        yield name, path


def _imports(name: str, path: pathlib.Path):
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("labkit"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("labkit"):
                yield target


def test_every_module_has_a_layer():
    for name, _ in _modules():
        assert name == "labkit" or name.split(".")[1] in LAYER, f"{name}: give it a layer in LAYER"


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_imports_point_down(name, path):
    """(labkit/__init__.py is exempt: it exposes `labkit.setup`, whose module imports only the standard library
    until it is called; the fresh-interpreter test below checks that importing a layer loads nothing above.)"""
    if name == "labkit":
        return
    own = _layer_of(name)
    up = [t for t in _imports(name, path) if _layer_of(t) > own and t != "labkit"]
    assert not up, f"{name} (layer {own}) imports from a higher layer: {up}"


def test_no_import_cycles_between_packages():
    """The package graph (labkit.memory -> labkit.optim, ...) has no cycle."""
    graph: dict[str, set[str]] = {}
    for name, path in _modules():
        src = ".".join(name.split(".")[:2])
        for t in _imports(name, path):
            dst = ".".join(t.split(".")[:2])
            if dst != src and dst != "labkit":
                graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for m in graph.get(n, ()):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [n, m]))
            if not state.get(m):
                visit(m, stack + [n])
        state[n] = 2

    for n in list(graph):
        if not state.get(n):
            visit(n, [])


ABOVE = {"labkit.memory": ["labkit.optim", "labkit.peft", "labkit.quant", "labkit.estimate", "labkit.run", "labkit.viz"],
         "labkit.optim": ["labkit.estimate", "labkit.run", "labkit.viz", "labkit.exercises"],
         "labkit.peft": ["labkit.estimate", "labkit.run", "labkit.viz", "labkit.exercises"],
         "labkit.recompute": ["labkit.estimate", "labkit.run", "labkit.viz", "labkit.exercises"],
         "labkit.estimate": ["labkit.run", "labkit.viz", "labkit.exercises", "labkit.cli"],
         "labkit.run": ["labkit.viz", "labkit.exercises", "labkit.cli"]}


@pytest.mark.parametrize("layer", list(ABOVE))
def test_a_fresh_interpreter_loads_nothing_above(layer):
    code = (f"import sys, {layer}; above = {ABOVE[layer]!r}; "
            "print(sorted(m for m in sys.modules if any(m == a or m.startswith(a + '.') for a in above)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing {layer} loaded {out}"
