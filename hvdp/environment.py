"""hvdp's own environment variables, checked when the job starts (:func:`check`, from :func:`hvdp.init`): a value
hvdp does not know is refused there, naming the variable, the values it takes and what each does, rather than
read as something else later (an ``HVDP_EARLY_WAKE=off`` taken as on, say).
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Mapping, Optional

from hvdp.backends import direct


def _one_of(name: str, allowed: Dict[str, str]) -> Callable[[str], None]:
    def check(value: str) -> None:
        if value.strip() not in allowed:
            choices = "; ".join(f"{choice!r}: {meaning}" for choice, meaning in allowed.items())
            raise ValueError(f"{name}={value!r} is not a value hvdp knows. Use one of: {choices}.")
    return check


def _steps(name: str) -> Callable[[str], None]:
    def check(value: str) -> None:
        if not value.strip().isdigit():
            raise ValueError(f"{name}={value!r} is not a value hvdp knows: give a whole number of steps >= 0 between "
                             f"two drift checks (0 turns the check off; the default is 100).")
    return check


#: Each variable hvdp reads in a job, and how its value is checked (unset or empty is always the default).
VARIABLES: Dict[str, Callable[[str], object]] = {
    "HVDP_EARLY_WAKE": _one_of("HVDP_EARLY_WAKE", {
        "1": "the default, Horovod's background loop is woken as soon as a tensor is submitted",
        "0": "it waits for its next cycle, as Horovod does"}),
    "HVDP_SHARED_MEMORY": _one_of("HVDP_SHARED_MEMORY", {
        "1": "the default, ranks on one machine reduce large tensors through shared memory",
        "0": "through Gloo's ring"}),
    direct.PATH_ENV: _one_of(direct.PATH_ENV, {
        "direct": "the default, gradients and calls reduced without Horovod's per-cycle coordination once the "
                  "ranks agree",
        "horovod": "Horovod's path"}),
    direct.QUIET_ENV: direct.quiet_ms_from,
    "HVDP_CHECK_EVERY": _steps("HVDP_CHECK_EVERY"),
}


def check(environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse a value of :data:`VARIABLES` that hvdp does not know (ValueError naming it and the choices).

    Example:
        >>> check({"HVDP_EARLY_WAKE": "0"})
    """
    environ = os.environ if environ is None else environ
    for name, validate in VARIABLES.items():
        value = environ.get(name)
        if value is not None and value.strip():
            validate(value)
