"""The layers import downwards only, between labkit's packages and between the modules of a package.

ORDER lists labkit's packages (and top-level modules) from the bottom up; a package may import only itself and
the packages before it. MODULE_ORDER does the same for the modules inside a package where their order is part
of the design (memory's types below the ledger; the estimator's textbook formulas below its exact layer, the
single-device estimate below data, tensor and pipeline parallelism, and those below the front door). Every
other package has no import circle among its modules. Each check reads every `import` statement (module level,
inside a function, or under TYPE_CHECKING), and every module is imported in an interpreter where no labkit
module was loaded yet, which must load nothing from a package above its own.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

import labkit

ROOT = pathlib.Path(labkit.__file__).parent
ORDER = ["memory", "paths", "quant", "precision", "recompute", "data", "models", "device", "optim", "distributed",
         "accumulate", "peft", "estimate", "run", "session", "plan", "viz", "exercises", "course", "cli", "colab", "__main__"]
MODULE_ORDER = {
    "memory": ["units", "table", "allocator", "state", "report", "memviz", "replay", "budget", "ledger"],
    "estimate": ["refusal", "recipe", "textbook", "tape", "spec", "optim_terms", "peft_terms", "walk", "families",
                 "walk_groups", "step_bytes", "held", "moments_step", "moments_backward", "moments_forward",
                 "moments", "predict", "keyed", "zero_terms", "layout_terms", "estimator",
                 "wall", "host"],
}


def _package(module: str) -> str:
    """labkit.memory.ledger -> memory; labkit -> '' (labkit/__init__.py, exempt: see test_imports_point_down)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        yield name, path


MODULES = dict(_modules())


def _imports(name: str, path: pathlib.Path):
    """Every labkit module or package `name`'s source imports (`from . import x` names labkit.pkg.x)."""
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
                yield from (f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES)


def _module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (the package's __init__ left out: it exposes them)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if _package(name) != package or name == f"labkit.{package}":
            continue
        graph[name] = {t for t in _imports(name, path) if t in MODULES and _package(t) == package
                       and t != f"labkit.{package}" and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack + [n, m]
            if not state.get(m):
                found = visit(m, stack + [n])
                if found:
                    return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if not state.get(n):
            found = visit(n, [])
            if found:
                return found
    return None


def test_every_package_and_ordered_module_is_declared():
    packages = {_package(n) for n in MODULES} - {""}
    assert packages <= set(ORDER), f"give these a place in ORDER: {sorted(packages - set(ORDER))}"
    for pkg, order in MODULE_ORDER.items():
        have = {n.rsplit(".", 1)[1] for n in _module_graph(pkg)}
        assert have == set(order), f"labkit.{pkg}: MODULE_ORDER misses {sorted(have - set(order))}, " \
                                   f"names gone modules {sorted(set(order) - have)}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    """(labkit/__init__.py is exempt: it exposes `labkit.setup`, whose module imports only the standard library
    until it is called; the fresh-interpreter test below checks that importing a package loads nothing above.)"""
    if name == "labkit":
        return
    own = ORDER.index(_package(name))
    up = sorted({t for t in _imports(name, MODULES[name]) if t != "labkit" and ORDER.index(_package(t)) > own})
    assert not up, f"{name} (package {ORDER[own]}) imports from packages above it in ORDER: {up}"


@pytest.mark.parametrize("package", sorted(MODULE_ORDER))
def test_modules_of_an_ordered_package_import_only_those_before_them(package):
    order = MODULE_ORDER[package]
    for name, targets in _module_graph(package).items():
        own = order.index(name.rsplit(".", 1)[1])
        up = sorted(t for t in targets if order.index(t.rsplit(".", 1)[1]) > own)
        assert not up, f"{name} imports {up}, above it in MODULE_ORDER[{package!r}]"


@pytest.mark.parametrize("package", [p for p in ORDER if (ROOT / p).is_dir()])
def test_no_import_circle_inside_a_package(package):
    cycle = _cycle(_module_graph(package))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _third_party() -> list[str]:
    """Every module outside labkit and the standard library that labkit's sources import."""
    found = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module)
    return sorted(m for m in found if not m.startswith("labkit") and m.split(".")[0] not in sys.stdlib_module_names)


# Import every third-party module labkit's sources name (torch, transformers, bitsandbytes, ...; one that is not
# installed is passed over) and `labkit` itself (its __init__ loads labkit.session, which imports only the standard
# library until called) once, then fork one child per module: each child starts with no other labkit module
# loaded, imports one module and prints the packages above its own that got loaded. (What the child loads from
# outside labkit is not what the check is about, so the children need not import it again each.) A module that a
# passing child loaded from its own package needs no child of its own: a fresh import of it loads a subset of what
# that child loaded, all of it at or below their package.
_FRESH = r"""
import importlib, os, sys
for m in {third_party!r}:
    try:
        importlib.import_module(m)
    except Exception:
        pass
import labkit
order, names, out = {order!r}, {names!r}, []
before = set(sys.modules)
assert sorted(m for m in before if m.startswith("labkit")) == ["labkit", "labkit.session"], sorted(before)
covered = set()
for name in names:
    if name in covered:
        continue
    pkg = name.split(".")[1]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            new = [m for m in set(sys.modules) - before if m.startswith("labkit.")]
            above = sorted({{m.split(".")[1] for m in new if order.index(m.split(".")[1]) > order.index(pkg)}})
            msg = ("ABOVE " + ",".join(above)) if above else "OK " + ",".join(new)
        except BaseException as e:
            msg = "ERROR " + type(e).__name__ + ": " + str(e)
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    msg = b"".join(chunks).decode()
    os.waitpid(pid, 0)
    if msg.startswith("OK "):
        covered |= {{m for m in msg[3:].split(",") if m and m.split(".")[1] == pkg}}
    else:
        out.append(name + ": " + msg.removeprefix("ABOVE "))
print("\n".join(out))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fresh-interpreter check forks")
def test_each_module_in_a_fresh_interpreter_loads_nothing_above_its_package():
    names = sorted(n for n in MODULES if n != "labkit" and not n.startswith("labkit.__main__"))
    code = _FRESH.format(order=ORDER, names=names, third_party=_third_party())
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT.parent)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "", "importing these loaded packages above their own:\n" + run.stdout
