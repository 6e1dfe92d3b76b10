"""One rank of a job that compares every rank's bits after every step: its averaged gradients after each
backward pass, its parameters and Adam's moments after each update.

Run by tests/cluster/test_bit_identical.py under `hvdp run` (one rank per host, or both on one); writes
$HVDP_TEST_OUT/rank<N>.json with what differed, if anything, at which step and on which path.

The model is sized so that the direct gradient path cuts, after its learning step, an in-place bucket (a
matrix of 512 x 512, alone, reduced in its own ``.grad``), a gathered bucket of about 1 MB and a last
gathered one with the counts (the two small gathered buckets in a row take lanes 0 and 1): every kind of
bucket, both lanes, the sender's scale and the last bucket's. Each rank trains on batches of its own, and
``HVDP_TEST_THREADS`` (comma separated, by rank) gives each rank its own number of torch threads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

import hvdp


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def model_and_optimizer(seed: int) -> Tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),  # 262144 elements: the in-place bucket
        torch.nn.Linear(512, 500), torch.nn.ReLU(),
        torch.nn.Linear(500, 10))
    optimizer = hvdp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.002), model)
    hvdp.broadcast_state(model, optimizer)
    return model, optimizer


def states(optimizer: Any, names: Dict[Any, str]) -> List[Tuple[str, torch.Tensor]]:
    found = []
    for p, name in names.items():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                found.append((f"{name}.{key}", value))
    return found


def compare(what: str, step: int, tensors: List[Tuple[str, torch.Tensor]], path: str) -> List[dict]:
    """Every rank's digests of ``tensors`` (a collective); for each that differs, how far (a second one)."""
    everyone = hvdp.allgather_object([digest(t) for _, t in tensors])
    differing = [i for i in range(len(tensors)) if len({theirs[i] for theirs in everyone}) > 1]
    found = []
    for i in differing:  # the same list on every rank: every rank takes part in each gather
        name, tensor = tensors[i]
        values = [np.asarray(v, dtype=np.float32) for v in hvdp.allgather_object(
            tensor.detach().reshape(-1).numpy())]
        gap = np.abs(values[1].astype(np.float64) - values[0].astype(np.float64))
        at = int(np.argmax(gap))
        ulps = float(gap[at] / np.spacing(np.abs(values[0][at])))
        found.append({"what": what, "step": step, "name": name, "path": path,
                      "elements": int(np.count_nonzero(gap)), "of": int(gap.size),
                      "max_gap": float(gap[at]), "ulps": ulps})
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvdp.init(framework="torch")
    rank = hvdp.rank()
    threads = os.environ.get("HVDP_TEST_THREADS", "")
    if threads:
        torch.set_num_threads(int(threads.split(",")[rank]))
    model, optimizer = model_and_optimizer(args.seed)
    names = {p: n for n, p in model.named_parameters()}
    loss_fn = torch.nn.CrossEntropyLoss()
    data = np.random.default_rng(1000 + rank)  # each rank its own batches
    path = getattr(optimizer, "gradient_path", None)
    mismatches: List[dict] = []
    paths: List[str] = []
    for step in range(1, args.steps + 1):
        x = torch.from_numpy(data.standard_normal((32, 64), dtype=np.float32))
        y = torch.from_numpy(data.integers(0, 10, 32))
        optimizer.zero_grad()
        taken = "horovod" if path is None or path.mode != "direct" else "direct"
        loss_fn(model(x), y).backward()  # .grad holds the averages when backward returns
        paths.append(taken)
        mismatches += compare("gradient", step, [(n, p.grad) for p, n in names.items()], taken)
        optimizer.step()
        mismatches += compare("parameter", step, [(n, p) for p, n in names.items()], taken)
        mismatches += compare("state", step, states(optimizer, names), taken)
    plan = []
    if path is not None:
        plan = [{"params": [names[p] for p in bucket.params], "in_place": bucket.in_place,
                 "lane": bucket.lane} for bucket in getattr(path, "buckets", [])]
    report = {"rank": rank, "size": hvdp.size(), "local_size": hvdp.local_size(), "steps": args.steps,
              "paths": paths, "threads": torch.get_num_threads(), "mismatches": mismatches, "plan": plan,
              "counts": dict(getattr(path, "counts", {}))}
    Path(os.environ["HVDP_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(report))
    hvdp.shutdown()


if __name__ == "__main__":
    main()
