"""The checkpoint file: round trip, atomic writes under kill -9, and every bad file named clearly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hvdp import checkpoint
from hvdp.errors import CheckpointError

MODEL = {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "fc.bias": np.zeros(2, np.float32)}
OPTIMIZER = {"state": {0: {"step": np.array(3.0), "exp_avg": np.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}


def test_round_trip_keeps_arrays_structure_and_extras(tmp_path):
    path = tmp_path / "ck.npz"
    checkpoint.write(path, "torch", MODEL, OPTIMIZER, {"epoch": 4, "history": [0.5, 0.25]})
    model, optimizer, extras = checkpoint.read(path, "torch")
    assert list(model) == list(MODEL) and all(np.array_equal(model[k], MODEL[k]) for k in MODEL)
    assert model["fc.weight"].dtype == np.float32
    assert optimizer["state"][0]["step"].shape == () and optimizer["param_groups"] == OPTIMIZER["param_groups"]
    assert extras == {"epoch": 4, "history": [0.5, 0.25]}
    assert [p.name for p in tmp_path.iterdir()] == ["ck.npz"]  # no temporary file left


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "ck.npz"
    checkpoint.write(path, "torch", MODEL, OPTIMIZER, {"epoch": 1})
    writer = subprocess.Popen([sys.executable, "-c", (
        "import numpy as np, sys; from hvdp import checkpoint\n"
        "big = {f'w{i}': np.random.rand(2_000_000) for i in range(8)}\n"
        "print('writing', flush=True)\n"
        f"checkpoint.write({str(path)!r}, 'torch', big, {{}}, {{'epoch': 2}})\n")],
        stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    deadline = time.time() + 30
    while not list(tmp_path.glob(".ck.npz.*.tmp")) and time.time() < deadline:
        time.sleep(0.01)
    assert list(tmp_path.glob(".ck.npz.*.tmp")), "the writer never started its temporary file"
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    _, _, extras = checkpoint.read(path, "torch")
    assert extras == {"epoch": 1}


def test_truncated_and_corrupt_files_are_named(tmp_path):
    path = tmp_path / "ck.npz"
    checkpoint.write(path, "torch", MODEL, OPTIMIZER, {})
    data = path.read_bytes()
    (tmp_path / "half.npz").write_bytes(data[: len(data) // 2])
    (tmp_path / "noise.npz").write_bytes(b"not a checkpoint at all" * 10)
    for name in ("half.npz", "noise.npz"):
        with pytest.raises(CheckpointError, match=f"{name} is corrupt or truncated"):
            checkpoint.read(tmp_path / name, "torch")
    np.savez(tmp_path / "plain.npz", a=np.ones(2))
    with pytest.raises(CheckpointError, match="plain.npz is not an hvdp checkpoint"):
        checkpoint.read(tmp_path / "plain.npz", "torch")
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.read(tmp_path / "missing.npz", "torch")


def test_checkpoint_from_the_other_framework_is_refused(tmp_path):
    path = tmp_path / "ck.npz"
    checkpoint.write(path, "tensorflow", MODEL, {}, {})
    with pytest.raises(CheckpointError, match="written by a tensorflow job; this job runs torch"):
        checkpoint.read(path, "torch")


def test_architecture_mismatch_names_the_parameters(tmp_path):
    with pytest.raises(CheckpointError) as err:
        checkpoint.check_architecture("ck.npz", [("fc.weight", (4, 3)), ("head.bias", (2,))], MODEL)
    message = str(err.value)
    assert "missing from the file: head.bias" in message and "not in the model: fc.bias" in message
    assert "fc.weight (2, 3) in the file vs (4, 3) in the model" in message


def test_extras_that_cannot_be_stored_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="cannot store a object"):
        checkpoint.write(tmp_path / "ck.npz", "torch", MODEL, {}, {"bad": object()})
