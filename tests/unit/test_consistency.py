"""The drift guard's pure parts: its interval, its message, and the uneven-step line."""

from __future__ import annotations

import numpy as np
import pytest

from hvdp import _state, consistency
from hvdp.errors import ReplicaMismatchError


def test_interval_comes_from_the_argument_then_the_environment_then_the_default(monkeypatch):
    monkeypatch.delenv("HVDP_CHECK_EVERY", raising=False)
    assert consistency.check_every(None) == consistency.DEFAULT_CHECK_EVERY == 100
    monkeypatch.setenv("HVDP_CHECK_EVERY", "0")
    assert consistency.check_every(None) == 0
    assert consistency.check_every(7) == 7


@pytest.mark.parametrize("raw", ["ten", "-1", "2.5"])
def test_a_bad_environment_interval_names_the_variable_and_the_fix(monkeypatch, raw):
    monkeypatch.setenv("HVDP_CHECK_EVERY", raw)
    with pytest.raises(ValueError, match=rf"HVDP_CHECK_EVERY='{raw}'.*0 turns the drift check off"):
        consistency.check_every(None)


@pytest.mark.parametrize("bad", [-3, True, 1.5])
def test_a_bad_argument_is_refused(bad):
    with pytest.raises(ValueError, match="check_every="):
        consistency.check_every(bad)


class Gathered:
    """Two ranks' gathered digests: this rank's own, and rank 1's (``other`` rewrites them)."""

    def __init__(self, other):
        self.other = other

    def __call__(self, mine):
        if isinstance(mine, np.ndarray):  # the values of the first differing parameter
            return [mine, mine + 1]
        return [mine, self.other(mine)]


def test_guard_checks_after_step_one_and_every_n_steps_and_names_the_step():
    params = [("w", np.zeros(3, np.float32)), ("b", np.ones(1, np.float32))]
    calls = []
    guard = consistency.DriftGuard(lambda mine: calls.append(1) or [mine, mine], [0, 1], 3, whole_job=False)
    for _ in range(7):
        guard.after_step(lambda: params)
    assert len(calls) == 3  # steps 1, 3 and 6
    seen = []  # rank 1 agrees at steps 1 and 2, then its "b" differs

    def other(mine):
        seen.append(1)
        return mine if len(seen) <= 2 else [mine[0], ("b", [1], "changed")]

    drifted = consistency.DriftGuard(Gathered(other), [0, 1], 2, whole_job=False)
    drifted.after_step(lambda: params)
    drifted.after_step(lambda: params)  # step 2: checked (every 2)
    drifted.after_step(lambda: params)  # step 3: not checked
    with pytest.raises(ReplicaMismatchError) as err:
        drifted.after_step(lambda: params)
    message = str(err.value)
    assert "by step 4" in message and "rank 1 (1 of 2 parameters differ, e.g. b)" in message
    assert "hvdp.broadcast_state(model, optimizer)" in message and "load_model" in message
    assert "HVDP_CHECK_EVERY" in message


def test_ranks_waiting_in_a_join_are_left_out_and_the_first_stepping_rank_is_the_reference():
    params = [("w", np.zeros(3, np.float32))]
    theirs = [("w", [3], "changed")]
    guard = consistency.DriftGuard(lambda mine: [None, mine, mine if isinstance(mine, np.ndarray) else theirs],
                                   [0, 1, 2], 1, whole_job=False)
    with pytest.raises(ReplicaMismatchError) as err:
        guard.after_step(lambda: params)
    assert "compared with rank 1, rank 2 (1 of 1 parameters differ, e.g. w)" in str(err.value)
    agreeing = consistency.DriftGuard(lambda mine: [None, mine, mine], [0, 1, 2], 1, whole_job=False)
    agreeing.after_step(lambda: params)


def test_off_checks_nothing():
    guard = consistency.DriftGuard(lambda mine: pytest.fail("gathered"), [0, 1], 0, whole_job=False)
    for _ in range(5):
        guard.after_step(lambda: pytest.fail("listed"))


class Counts:
    def __init__(self, others):
        self.others = others

    def allgather_object(self, mine, handle):
        return [mine, *self.others]


def test_uneven_steps_name_every_rank_count_and_even_ones_say_nothing(monkeypatch):
    state = _state.JobState(job_steps=5)
    monkeypatch.setattr(_state, "_job", state)
    assert consistency.uneven_steps(Counts([5])) == []
    state.job_steps = 5
    [line] = consistency.uneven_steps(Counts([4]))
    assert line.startswith("The ranks took different numbers of optimizer steps (rank 0: 5, rank 1: 4)")
    assert state.job_steps == 0


def test_elastic_jobs_run_no_guard(monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.delenv("HVDP_CHECK_EVERY", raising=False)
    assert consistency.check_every(None) == 0
    assert consistency.check_every(5) == 0


def test_parameters_are_compared_by_position_not_by_their_names():
    ours = [("dense/kernel", [2], "a"), ("dense/bias", [1], "b")]
    renamed = [("dense_2/kernel", [2], "a"), ("dense_2/bias", [1], "b")]  # a rank-only model shifted Keras's names
    assert consistency.problems([ours, renamed], [0, 1]) == []
    changed = [("dense_2/kernel", [2], "a"), ("dense_2/bias", [1], "c")]
    assert consistency.problems([ours, changed], [0, 1]) == ["rank 1 (1 of 2 parameters differ, e.g. dense/bias)"]


def values_gather(others):
    """Rank 0's digests and values as given; ranks 1... return ``others[i](mine)`` (None: waiting in a join)."""
    return lambda mine: [mine, *[None if other is None else other(mine) for other in others]]


def test_the_message_says_how_far_the_first_differing_parameter_is_on_each_rank():
    w = np.linspace(0.1, 1.0, 8, dtype=np.float32)
    params = [("a", np.zeros(2, np.float32)), ("w", w)]
    one_ulp = w.copy()
    one_ulp[3] = np.nextafter(w[3], np.float32(2))
    stepped = w - 0.01

    def rank(values):
        def other(mine):
            if isinstance(mine, np.ndarray):
                return values
            return [mine[0], ("w", [8], "different")]
        return other

    guard = consistency.DriftGuard(values_gather([rank(one_ulp), None, rank(stepped)]), [0, 1, 2, 3], 1,
                                   whole_job=False)
    with pytest.raises(ReplicaMismatchError) as err:
        guard.after_step(lambda: params)
    message = str(err.value)
    assert "rank 1 (1 of 2 parameters differ, e.g. w); rank 3 (1 of 2 parameters differ, e.g. w)." in message
    assert ("On w, against rank 0: rank 1: 1 of 8 elements, by at most 2.98e-08 (1 unit in the last place "
            "of 0.485714)") in message
    assert "rank 3: 8 of 8 elements, by at most 0.01 (" in message
    assert "rounding size" not in message  # rank 3 is a step away: a missed or different update
    only_rounding = consistency.DriftGuard(values_gather([rank(one_ulp)]), [0, 1], 1, whole_job=False)
    with pytest.raises(ReplicaMismatchError, match="Differences of rounding size"):
        only_rounding.after_step(lambda: params)


def test_a_difference_in_architecture_or_an_unreadable_value_keeps_the_plain_message():
    params = [("w", np.zeros(2, np.float32))]
    assert consistency.how_far(pytest.fail, params, [[("w", [2], "a")], [("w", [3], "b")]], [0, 1]) == ""
    odd = consistency.how_far(lambda mine: [mine, "not an array"], params,
                              [[("w", [2], "a")], [("w", [2], "b")]], [0, 1])
    assert odd == ""
