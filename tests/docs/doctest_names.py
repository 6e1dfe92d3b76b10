"""pytest plugin for the doctest run over hvdp (test_docstrings.py): hvdp's docstrings
assume ``import hvdp``, as the package's own docstring shows."""

import pytest

import hvdp


@pytest.fixture(autouse=True)
def _hvdp_in_doctests(doctest_namespace):
    doctest_namespace["hvdp"] = hvdp
