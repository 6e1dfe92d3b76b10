"""hvdp.profiler in one process: off by default, one JSON line per step when on."""

from __future__ import annotations

import json
import time

import pytest

from hvdp import profiler


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(profiler.ENV_VAR, raising=False)
    profiler.disable()
    yield
    profiler.disable()


def test_off_by_default_records_nothing(tmp_path):
    with profiler.phase("data"):
        pass
    profiler.step()
    assert profiler.is_enabled() is False and list(tmp_path.iterdir()) == []


def test_phases_and_steps_are_written_per_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_RANK", "3")
    profiler.enable(str(tmp_path / "prof"))
    for _ in range(2):
        with profiler.phase("data"):
            time.sleep(0.02)
        with profiler.phase("compute"):
            time.sleep(0.01)
        profiler.record("sync", 0.005)
        profiler.step(examples=8)
    profiler.disable()  # closes (and flushes) the file; a process does so at exit
    lines = [json.loads(line) for line in (tmp_path / "prof" / "rank3.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        assert line["phases"]["data"] >= 0.02 and line["phases"]["compute"] >= 0.01
        assert line["phases"]["sync"] == pytest.approx(0.005)
        assert line["seconds"] >= 0.03 and line["examples"] == 8


def test_environment_variable_turns_it_on(tmp_path, monkeypatch):
    monkeypatch.setenv(profiler.ENV_VAR, str(tmp_path))
    assert profiler.is_enabled()


def test_enable_without_a_directory_says_how():
    with pytest.raises(ValueError, match="needs a directory"):
        profiler.enable()
