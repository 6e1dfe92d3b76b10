"""hvdp run starts horovodrun in-process (python -m hvdp.launch.horovodrun) with Horovod's build checks
asked once per Horovod install and kept in hvdp's cache; everything else is horovodrun's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hvdp.launch import horovodrun
from hvdp.launch.command import in_process


def test_a_check_is_asked_once_then_answered_from_the_cache(tmp_path):
    asked = []

    def gloo_built(verbose=False):
        asked.append(verbose)
        return True

    path = tmp_path / "checks" / "key.json"
    check = horovodrun.remembered(gloo_built, "gloo_built", path)
    assert check() is True and check(verbose=True) is True and asked == [False]
    assert json.loads(path.read_text()) == {"gloo_built": True}
    again = horovodrun.remembered(gloo_built, "gloo_built", path)  # the next launch, a new process
    assert again() is True and asked == [False]
    other = horovodrun.remembered(lambda verbose=False: False, "mpi_built", path)
    assert other() is False and json.loads(path.read_text()) == {"gloo_built": True, "mpi_built": False}


def test_an_unwritable_or_corrupt_cache_only_means_asking_again(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    asked = []
    check = horovodrun.remembered(lambda verbose=False: asked.append(1) or True, "gloo_built",
                                  blocked / "sub" / "key.json")
    assert check() is True and check() is True and asked == [1, 1]
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    assert horovodrun.remembered(lambda verbose=False: "yes", "gloo_built", corrupt)() == "yes"


def test_the_key_follows_horovods_extension_libraries(tmp_path, monkeypatch):
    key = horovodrun.extension_key()
    assert key is not None and len(key) == 16 and horovodrun.extension_key() == key
    monkeypatch.setenv("HVDP_CACHE_DIR", str(tmp_path))
    assert horovodrun.cache_file(key) == tmp_path / "build-checks" / f"{key}.json"


def test_only_horovodrun_is_started_in_process():
    assert in_process(["/v/bin/horovodrun", "-np", "2", "python", "t.py"], "py") == \
        ["py", "-m", "hvdp.launch.horovodrun", "-np", "2", "python", "t.py"]
    assert in_process(["mpirun", "-np", "2"], "py") == ["mpirun", "-np", "2"]


def test_the_module_is_horovodruns_command_line(tmp_path):
    """Its help is horovodrun's own (and nothing of a job starts for it)."""
    env = {**os.environ, "HVDP_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "hvdp.launch.horovodrun", "--help"], capture_output=True,
                          text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0 and "usage: horovodrun" in proc.stdout and "--gloo" in proc.stdout, proc.stderr
