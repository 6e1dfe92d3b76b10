"""hvdp's environment variables refuse values hvdp does not know, at hvdp.init(), naming the choices."""

from __future__ import annotations

import pytest

import hvdp
from hvdp import environment

pytestmark = pytest.mark.unit

GOOD = {"HVDP_EARLY_WAKE": ["0", "1", " 1 "], "HVDP_SHARED_MEMORY": ["0", "1"],
        "HVDP_GRADIENT_PATH": ["direct", "horovod"], "HVDP_QUIET_LOOP_MS": ["0", "50", "10000"],
        "HVDP_CHECK_EVERY": ["0", "100"]}
BAD = {"HVDP_EARLY_WAKE": ("off", "'0': it waits"), "HVDP_SHARED_MEMORY": ("yes", "'1': the default"),
       "HVDP_GRADIENT_PATH": ("fast", "'horovod'"), "HVDP_QUIET_LOOP_MS": ("-5", "0 to keep"),
       "HVDP_CHECK_EVERY": ("-1", "0 turns the check off")}


def test_every_variable_hvdp_reads_is_checked():
    assert set(environment.VARIABLES) == set(GOOD) == set(BAD)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_known_values_and_unset_pass(name):
    for value in GOOD[name] + [""]:
        environment.check({name: value})
    environment.check({})


@pytest.mark.parametrize("name", sorted(BAD))
def test_an_unknown_value_is_refused_naming_the_variable_and_the_choices(name):
    value, choice = BAD[name]
    with pytest.raises(ValueError) as refused:
        environment.check({name: value})
    assert f"{name}={value!r}" in str(refused.value) and choice in str(refused.value)


def test_init_refuses_before_starting_anything(monkeypatch):
    monkeypatch.setenv("HVDP_EARLY_WAKE", "off")
    with pytest.raises(ValueError, match="HVDP_EARLY_WAKE='off'"):
        hvdp.init()
    assert not hvdp.is_initialized()
