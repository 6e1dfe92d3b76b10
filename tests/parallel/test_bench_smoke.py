"""A very small real `hvdp bench` run: hvdp vs DDP (torchrun) and vs MultiWorkerMirroredStrategy (TF_CONFIG
workers), one round of 3 steps. Figures are printed, not asserted; the JSON must hold every one of them
as a positive finite number."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from harness import REPO


def _numbers(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _numbers(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _numbers(value)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield tree


def test_bench_native_smoke(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run([sys.executable, "-m", "hvdp.cli", "bench", "--quick", "--only", "native", "--rounds", "1",
                           "--steps", "3", "--warmup", "1", "--json", str(out), "--plot", str(png)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert png.read_bytes()[:4] == b"\x89PNG"
    names = [g["name"] for g in data["groups"]]
    assert names == ["torch/cnn np=2 gloo", "tensorflow/cnn np=2 gloo"]
    torch_group, tf_group = data["groups"]
    assert set(torch_group["ratios"]) == {"hvdp/ddp"} and set(tf_group["ratios"]) == {"hvdp/mwms"}
    for group in data["groups"]:
        for figures in group["contenders"].values():
            assert len(figures["run_step_seconds"]) == 1
            for key in ("step_seconds", "examples_per_second"):
                assert figures[key] > 0 and math.isfinite(figures[key])
    numbers = list(_numbers({"groups": data["groups"], "targets": [t["value"] for t in data["targets"]
                                                                    if t["value"] is not None]}))
    assert numbers and all(math.isfinite(n) and n > 0 for n in numbers
                           if not isinstance(n, int) or n > 0), numbers
    measured = {t["name"]: t for t in data["targets"] if t["value"] is not None}
    assert set(measured) == {"hvdp/DDP step time, torch/cnn np=2",
                             "hvdp/MultiWorkerMirrored step time, tensorflow/cnn np=2"}
    assert "targets" in proc.stdout
