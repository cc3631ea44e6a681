"""One version: pyproject.toml's [project] version, labkit.__version__ and the newest CHANGELOG release agree."""

import pathlib
import re
import tomllib

import labkit

ROOT = pathlib.Path(__file__).parents[2]


def test_pyproject_and_package_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == labkit.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", labkit.__version__)


def test_changelog_names_the_version_first():
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", text, flags=re.M)
    assert releases, "CHANGELOG.md has no '## [x.y.z] - YYYY-MM-DD' entry"
    assert releases[0][0] == labkit.__version__
    assert "## [Unreleased]" in text.split(f"## [{releases[0][0]}]")[0]
    assert f"[{labkit.__version__}]: " in text  # the link reference Keep a Changelog ends with
