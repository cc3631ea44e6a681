"""The two install routes (pyproject.toml for pip, environment.yml for conda) name the same packages,
and the Makefile installs the packages that must go in with `pip install --no-deps`."""

import re
import shlex
import tomllib
from pathlib import Path

from labkit import colab

ROOT = Path(__file__).resolve().parents[2]

# conda-forge names that differ from the PyPI distribution name
CONDA_TO_PYPI = {"pytorch": "torch"}
# in environment.yml but not packages of the project: the interpreter and the installer
NOT_DEPENDENCIES = {"python", "pip"}
NO_DEPS = list(colab.NO_DEPS)  # the Colab install cell installs the same ones the same way


def normalise(requirement: str) -> str:
    """'Lion_Pytorch >=0.2' -> 'lion-pytorch' (name only, PEP 503-ish)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    name = name.lower().replace("_", "-").replace(".", "-")
    return CONDA_TO_PYPI.get(name, name)


def pyproject_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for reqs in project.get("optional-dependencies", {}).values() for r in reqs]
    return project["dependencies"] + [r for r in extras if normalise(r) != "labkit"]  # not `test`'s labkit[...]


def environment_requirements(text: str) -> list[str]:
    """Every `- item` under `dependencies:`, including the nested `- pip:` list (a tiny YAML subset)."""
    items, inside = [], False
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not raw.startswith((" ", "-")):  # a top-level key
            inside = line.startswith("dependencies:")
            continue
        item = line.strip()
        if inside and item.startswith("- "):
            item = item[2:].strip()
            if item != "pip:":
                items.append(item)
    return items


def test_tiny_parser_reads_nested_pip_section():
    text = "name: x\nchannels:\n  - conda-forge\ndependencies:\n  - python=3.11\n  - pytorch>=2.4  # c\n  - pip:\n      - Lion_Pytorch\nother:\n  - nope\n"
    assert environment_requirements(text) == ["python=3.11", "pytorch>=2.4", "Lion_Pytorch"]
    assert {normalise(r) for r in environment_requirements(text)} == {"python", "torch", "lion-pytorch"}


def test_pyproject_and_environment_yml_name_the_same_packages():
    from_pip = {normalise(r) for r in pyproject_requirements()}
    conda_items = environment_requirements((ROOT / "environment.yml").read_text())
    from_conda = {normalise(r) for r in conda_items} - NOT_DEPENDENCIES
    assert from_pip, "pyproject.toml lists no dependencies"
    assert from_pip - from_conda == set(), "in pyproject.toml but missing from environment.yml"
    assert from_conda - from_pip == set(), "in environment.yml but missing from pyproject.toml"
    assert any(item.startswith("python=3.11") for item in conda_items)


def test_no_deps_packages_are_installed_by_the_makefile_only():
    install_lines = [
        shlex.split(line.replace("$(PIP)", "pip"))
        for line in (ROOT / "Makefile").read_text().splitlines()
        if "install" in line and "--no-deps" in line
    ]
    for spec in NO_DEPS:
        assert any(spec in words for words in install_lines), f"Makefile does not `pip install --no-deps {spec}`"
        name = normalise(spec)
        assert name not in {normalise(r) for r in pyproject_requirements()}, f"{name} must not be a pyproject dependency"
        env_yml = (ROOT / "environment.yml").read_text()
        assert name not in {normalise(r) for r in environment_requirements(env_yml)}, f"{name} must not be a conda/pip dependency"


def test_torch_range_is_the_same_everywhere():
    torch_pip = [r for r in pyproject_requirements() if normalise(r) == "torch"]
    assert [r.replace(" ", "") for r in torch_pip] == ["torch>=2.4,<3"]
    conda = [r for r in environment_requirements((ROOT / "environment.yml").read_text()) if normalise(r) == "torch"]
    assert [r.replace(" ", "") for r in conda] == ["pytorch>=2.4,<3"]
    makefile_range = re.search(r"^TORCH_RANGE\s*=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert makefile_range and makefile_range.group(1) == "torch>=2.4,<3"


def test_ci_reruns_the_parity_tests_on_portable_kernels():
    """`make test-parity` reruns the `parity` tests with ATEN_CPU_CAPABILITY=default; CI runs `make check`, which
    is `make test`, then `make test-browser` followed by `make test-site` (the HTML book, from the lessons that
    make test-browser saved) beside `make test-parity`, `make test-colab` and `make course-audit`, two at a
    time."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest-parity:", 1)[1].split("\n\n", 1)[0]
    assert "ATEN_CPU_CAPABILITY=default" in recipe and "-m parity" in recipe and "LABKIT_SMOKE=1" in recipe
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert " -rs" in test_recipe  # skips say why
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if re.match(r"make [a-z-]+ </dev/null", line.strip())]
    assert ci == ["make check </dev/null"]
    check = makefile.split("\ncheck:", 1)[1].split("\n\n", 1)[0]
    steps = [line.strip() for line in check.splitlines()[1:]]
    assert steps[0] == "$(MAKE) test"  # alone: it uses every core
    rest = steps[1].split()
    assert rest[:2] == ["$(MAKE)", "-j2"] and "--output-sync=target" in rest
    assert sorted(rest[3:]) == ["course-audit", "test-browser-site", "test-colab", "test-parity"]
    assert len(steps) == 2
    browser_site = makefile.split("\ntest-browser-site:", 1)[1].split("\n\n", 1)[0]
    assert browser_site.split("\n")[0].split() == ["test-browser"] and "$(MAKE) test-site" in browser_site
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("parity:") for m in markers)
