"""A plain `pip install .` (what the Docker images run) ships every module of hvdp, not only an editable install."""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]


def test_every_folder_of_python_modules_is_a_package_setup_py_finds():
    packages = set(find_packages(str(REPO), include=["hvdp", "hvdp.*"]))
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "hvdp").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders - packages == set(), "add an __init__.py to these folders, or pip install . leaves them out"


def test_test_modules_have_unique_names():
    """pytest imports test files by their basename: two with one name stop the whole run at collection."""
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_the_framework_pins_are_the_specs():
    """setup.py's extras and the install hint hvdp.init gives name the requirement of each framework's spec."""
    import re

    from hvdp import _runtime
    from hvdp.frameworks import SPECS

    setup = (REPO / "setup.py").read_text()
    for name, spec in SPECS.items():
        assert re.search(rf'"{name}": \["{re.escape(spec.requirement)}"\]', setup), name
        assert _runtime.INSTALL_HINT[name] == f"pip install {spec.requirement}"
    assert tuple(SPECS) == _runtime.FRAMEWORKS
