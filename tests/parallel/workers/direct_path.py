"""torch's direct gradient path (hvdp.backends.torch.direct.gradients) beside Horovod's path in one job: the same model,
data and steps through two optimizers, one on each path (HVDP_GRADIENT_PATH read as each is built), for
several settings; a graph change on one rank (a layer skipped at one step); two optimizers over one backward
pass; small hvdp.allreduce calls. Each rank reports both models' parameters and the direct path's counts.
(A rank that stalls on the direct path: tests/parallel/test_faults.py; one that leaves its loop early:
test_core.py's uneven steps.)"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np
import torch
from _report import digest, write
from sklearn.datasets import load_digits

import hvdp
from hvdp.backends.torch.direct import allreduce as direct_allreduce

STEPS = 8
#: The step at which rank 1 leaves the middle layer out of its forward (its parameters get no gradient there).
SKIP_STEP = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = torch.nn.Linear(64, 96), torch.nn.Linear(96, 96), torch.nn.Linear(96, 10)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        hidden = torch.relu(self.fc1(x))
        if not skip:
            hidden = torch.relu(self.fc2(hidden))
        return self.head(hidden)


def batches(rank: int) -> List[Any]:
    """Rank r's batches: 16 digits each, a different slice per rank and step."""
    digits = load_digits()
    x, y = torch.from_numpy(digits.data.astype(np.float32) / 16.0), torch.from_numpy(digits.target)
    return [(x[i:i + 16], y[i:i + 16]) for i in range(rank * 400, rank * 400 + 16 * 2 * STEPS, 16)]


def built(path: str, **options: Any) -> Any:
    torch.manual_seed(0)
    model = Net()
    os.environ["HVDP_GRADIENT_PATH"] = path
    try:
        opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), model=model,
                                        **options)
    finally:
        del os.environ["HVDP_GRADIENT_PATH"]
    return model, opt


def train(path: str, options: Dict[str, Any], skip_rank: int = -1, passes: int = 1,
          local_first: bool = False, in_place: bool = False, lanes: bool = False, shm: bool = False) -> Dict[str, Any]:
    """``in_place``: the two hidden weights (6144 and 9216 elements) allreduced in their own .grad; ``lanes``:
    gathered buckets of 5000 elements, two of them, on the two sender lanes (else every gradient is gathered
    into one bucket); ``shm``: every bucket through shared memory (its threshold, 512 KB, lowered to 1 byte)."""
    from hvdp.backends.torch import buckets as planner
    from hvdp.backends.torch.direct import buckets
    from hvdp.backends.torch.direct import shm as direct_shm
    defaults = buckets.IN_PLACE, planner.FIRST, planner.BUCKET, direct_shm.BUCKET_MIN_BYTES
    buckets.IN_PLACE = 5000 if in_place else buckets.IN_PLACE
    if lanes:
        planner.FIRST = planner.BUCKET = 5000
    direct_shm.BUCKET_MIN_BYTES = 1 if shm else direct_shm.BUCKET_MIN_BYTES
    local = direct_allreduce.local_memory()
    served = local.served if local is not None else 0
    try:
        found = trained(path, options, skip_rank, passes, local_first)
    finally:
        buckets.IN_PLACE, planner.FIRST, planner.BUCKET, direct_shm.BUCKET_MIN_BYTES = defaults
    found["shared memory calls"] = (local.served if local is not None else 0) - served
    return found


def trained(path: str, options: Dict[str, Any], skip_rank: int, passes: int, local_first: bool) -> Dict[str, Any]:
    model, opt = built(path, **options)
    data = batches(hvdp.rank())
    modes, quiet = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(passes):
            x, y = data[(step * passes + k) % len(data)]
            skip = step == SKIP_STEP and hvdp.rank() == skip_rank
            if local_first and k == 0:
                with opt.no_sync():
                    torch.nn.functional.cross_entropy(model(x, skip), y).backward()
            else:
                torch.nn.functional.cross_entropy(model(x, skip), y).backward()
        opt.step()
        modes.append(opt.gradient_path.mode)  # the contract's: Horovod's path, or the direct path's mode
        quiet.append(direct_allreduce.is_quiet())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    went = opt.gradient_path
    direct = went if went.name == "direct" else None
    # A collective on Horovod's path (512 KB: not a small direct call) while its loop may be quiet.
    big = hvdp.allreduce(torch.full((1 << 17,), float(hvdp.rank() + 1)), op="sum", name=f"big.{path}.{options}")
    return {"params": flat.tolist(), "digest": digest(flat), "modes": modes, "quiet": quiet,
            "big": [float(big.min()), float(big.max())], "quiet after big": direct_allreduce.is_quiet(),
            "path": went.name, "counts": dict(went.counts),
            "buckets": None if direct is None else [b.in_place for b in direct.buckets],
            "lanes": None if direct is None else [b.lane for b in direct.buckets]}


def two_optimizers(path: str) -> Dict[str, Any]:
    """Two optimizers over one backward pass (the head and the body of one model): both paths' buckets go
    through the process's one sender thread in the order their hooks handed them over."""
    torch.manual_seed(0)
    model = Net()
    os.environ["HVDP_GRADIENT_PATH"] = path
    try:
        body = hvdp.DistributedOptimizer(torch.optim.SGD([*model.fc1.parameters(), *model.fc2.parameters()], lr=0.2),
                                         model, broadcast_buffers=False)
        head = hvdp.DistributedOptimizer(torch.optim.Adam(model.head.parameters(), lr=0.01), model,
                                         broadcast_buffers=False)
    finally:
        del os.environ["HVDP_GRADIENT_PATH"]
    data = batches(hvdp.rank())
    for step in range(STEPS):
        body.zero_grad()
        head.zero_grad()
        x, y = data[step]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        body.step()
        head.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return {"params": flat.tolist(), "digest": digest(flat),
            "counts": [dict(o.gradient_path.counts) for o in (body, head)]}


@contextmanager
def counted_rings() -> Iterator[List[int]]:
    """Inside: every call of Gloo's ring by hvdp.allreduce's large calls, counted (its element counts)."""
    from hvdp.backends.torch.direct import calls as direct_calls

    rings: List[int] = []
    entry = direct_calls._RING.entry
    direct_calls._RING.entry = lambda *args: rings.append(args[2]) or entry(*args)
    try:
        yield rings
    finally:
        direct_calls._RING.entry = entry


def compared(value: torch.Tensor, op: str, name: str) -> Dict[str, Any]:
    """hvdp.allreduce of ``value`` as it runs beside Horovod's path: the largest difference, and the result's kind."""
    direct, horovod = both_paths(value, op, name)
    return {"diff": float((direct.double() - horovod.double()).abs().max()), "dtype": str(direct.dtype),
            "shape": list(direct.shape), "numel": direct.numel(), "digest": digest(direct.double().numpy())}


def into_out_and_in_place(value: torch.Tensor, expected: torch.Tensor) -> Dict[str, Any]:
    """hvdp.allreduce (sum) of ``value`` into another tensor (the input must stay), then into itself."""
    kept, out = value.clone(), torch.empty_like(value)
    found = {"out=": {"returned_out": hvdp.allreduce(value, op="sum", out=out) is out,
                      "right": bool(torch.equal(out, expected)), "input unchanged": bool(torch.equal(value, kept))}}
    found["in place"] = {"returned_out": hvdp.allreduce(value, op="sum", out=value) is value,
                         "right": bool(torch.equal(value, expected))}
    return found


def both_paths(value: torch.Tensor, op: str, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """hvdp.allreduce of ``value`` as it runs (direct), and the same call on Horovod's path."""
    direct = hvdp.allreduce(value, op=op, name=name)
    os.environ["HVDP_GRADIENT_PATH"] = "horovod"
    try:
        return direct, hvdp.allreduce(value, op=op, name=f"{name}.h")
    finally:
        del os.environ["HVDP_GRADIENT_PATH"]


def calls() -> Dict[str, Any]:
    """hvdp.allreduce of small values (the direct exchange) beside the same call on Horovod's path, and the
    refusals of calls that differ between ranks; the call after each refusal must work."""
    rank, found = hvdp.rank(), {}
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        for op in ("sum", "average") if dtype.is_floating_point else ("sum",):
            value = (torch.arange(6, dtype=dtype).reshape(2, 3) + 3 * rank) * (1 if dtype.is_floating_point else 7)
            if dtype.is_floating_point:
                value = value / 3
            key = f"{str(dtype).replace('torch.', '')} {op}"
            direct, horovod = both_paths(value, op, f"call.{key}")
            found[key] = {"direct": direct.tolist(), "horovod": horovod.tolist(), "dtype": str(direct.dtype),
                          "shape": list(direct.shape)}
    array = np.array([1.5, 2.5]) * (rank + 1)
    out = np.empty_like(array)
    found["numpy out="] = {"returned_out": hvdp.allreduce(array, op="sum", out=out) is out, "out": out.tolist()}
    found["numbers"] = [hvdp.allreduce(2.0 + rank), hvdp.allreduce(2 + rank, op="sum")]
    found["refusals"] = refused(4)
    return found


def refused(n: int) -> Dict[str, Any]:
    """Calls of about ``n`` elements that differ between ranks by name, shape or dtype: each one's error, and the
    total of the call of ``n`` ones after it (which must work)."""
    rank, refusals = hvdp.rank(), {}
    for what, value, name in (("name", torch.ones(n), f"n{rank}"), ("shape", torch.ones(n + rank), "s"),
                              ("dtype", torch.ones(n, dtype=torch.float32 if rank else torch.float64), "d")):
        try:
            hvdp.allreduce(value, op="sum", name=name)
            refusals[what] = "no error"
        except Exception as error:
            refusals[what] = f"{type(error).__name__}: {error}"
        refusals[f"after {what}"] = float(hvdp.allreduce(torch.ones(n), op="sum").sum())
    return refusals


def large_calls() -> Dict[str, Any]:
    """hvdp.allreduce of tensors past the exchange's 256 KB (a header exchange, then Gloo's ring from the
    tensor into the result) beside Horovod's path: new tensors, out= (another tensor, the tensor itself, a
    NumPy array), a transposed input, and refusals of calls that differ between ranks."""
    rank, found = hvdp.rank(), {}
    with counted_rings() as rings:
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
            for op in ("sum", "average") if dtype.is_floating_point else ("sum",):
                value = ((torch.arange(300 * 257) % 97 + 5 * rank).reshape(300, 257)).to(dtype)
                key = f"{str(dtype).replace('torch.', '')} {op}"
                found[key] = compared(value / 3 if dtype.is_floating_point else value * 7, op, f"large.{key}")
        value = torch.arange(300 * 257, dtype=torch.float32).reshape(300, 257) * (rank + 1)
        expected = torch.arange(300 * 257, dtype=torch.float32).reshape(300, 257) * 3
        found.update(into_out_and_in_place(value, expected))
        array = np.full(100_000, 1.5) * (rank + 1)
        np_out = np.empty_like(array)
        found["numpy out="] = {"returned_out": hvdp.allreduce(array, op="sum", out=np_out) is np_out,
                               "right": bool((np_out == 4.5).all())}
        wide = torch.arange(300 * 257, dtype=torch.float32).reshape(300, 257) * (rank + 1)
        found["transposed"] = {"right": bool(torch.equal(hvdp.allreduce(wide.t(), op="sum"), expected.t()))}
        found["refusals"] = refused(70_000)
    found["ring calls"] = len(rings)
    return found


def shared_memory_calls() -> Dict[str, Any]:
    """hvdp.allreduce of tensors of SHM_MIN_BYTES and more, which go through shared memory (every rank is on this
    machine), beside Horovod's path; a direct call whose sizes differ between ranks, refused on both; a rank
    that cannot have the memory (its SHM_DIR missing), after which the channel keeps Gloo's ring on both."""
    from hvdp.backends.torch.direct import shm as direct_shm
    from hvdp.backends.torch.direct.allreduce import DirectAllreduce, local_memory

    rank, found = hvdp.rank(), {}
    local = local_memory()
    assert local is not None and local.on, "a Gloo job of 2 ranks on one machine"
    n = direct_shm.SHM_MIN_BYTES // 4 + 1000  # float32 elements: just past the threshold
    served = local.served
    with counted_rings() as rings:
        for dtype, op in ((torch.float32, "sum"), (torch.float32, "average"), (torch.float64, "sum"),
                          (torch.int32, "sum"), (torch.int64, "sum")):
            value = ((torch.arange(n) % 101 + 7 * rank) * (rank + 1)).to(dtype)
            found[f"{str(dtype).replace('torch.', '')} {op}"] = compared(
                value / 3 if dtype.is_floating_point else value, op, f"shm.{dtype}.{op}")
        expected = torch.arange(n, dtype=torch.float32) * 3
        found.update(into_out_and_in_place(torch.arange(n, dtype=torch.float32) * (rank + 1), expected))
        found["served"] = local.served - served
        local.on = False  # HVDP_SHARED_MEMORY=0: Gloo's ring
        try:
            mine = torch.arange(n, dtype=torch.float32) * (rank + 1)
            found["ring, switched off"] = bool(torch.equal(hvdp.allreduce(mine, op="sum"), expected))
        finally:
            local.on = True
    found["ring calls"] = len(rings)
    allreduce = DirectAllreduce(local=True)
    try:
        allreduce(torch.ones(n + 1024 * rank), 6)  # 4 KB more on rank 1: refused before any memory is read
        found["sizes differ"] = "no error"
    except Exception as error:
        found["sizes differ"] = f"{type(error).__name__}: {error}"
    after = torch.ones(n)
    allreduce(after, 6)
    found["after the refusal"] = float(after.sum())
    where = direct_shm.SHM_DIR
    direct_shm.SHM_DIR = "/nonexistent-hvdp-shm" if rank == 1 else where  # rank 1 cannot have the memory
    try:
        served, value = local.served, torch.full((n,), float(rank + 1))
        allreduce(value, 7)
        found["memory refused"] = {"right": bool((value == 3.0).all()), "ring only": local.channels[7].ring_only,
                                   "served": local.served - served}
    finally:
        direct_shm.SHM_DIR = where
    found["files left"] = [f for state in local.channels.values() for f in state.files if os.path.exists(f)]
    try:
        direct_shm.enabled_from("yes")
        found["setting refused"] = ""
    except ValueError as error:
        found["setting refused"] = str(error)
    return found


def main() -> None:
    hvdp.init(framework="torch")
    assert direct_allreduce.quiet_ms() == 50, "the quiet loop is on by default (HVDP_QUIET_LOOP_MS unset)"
    record: Dict[str, Any] = {"rank": hvdp.rank(), "size": hvdp.size(), "cases": {},
                              "controller": direct_allreduce.controller(),
                              "gradients direct": direct_allreduce.DirectAllreduce().usable()}
    settings = {"average": ({}, {}), "sum": ({"op": "sum"}, {}), "predivide": ({"gradient_predivide_factor": 2.0}, {}),
                "two passes": ({"backward_passes_per_step": 2}, {"passes": 2}),
                "no_sync": ({}, {"passes": 2, "local_first": True}),
                "graph change": ({}, {"skip_rank": 1}),
                "in place": ({}, {"in_place": True}), "in place, sum": ({"op": "sum"}, {"in_place": True}),
                "in place, two passes": ({"backward_passes_per_step": 2}, {"passes": 2, "in_place": True}),
                "in place, graph change": ({}, {"skip_rank": 1, "in_place": True}),
                "two lanes": ({}, {"lanes": True}), "two lanes, two passes": ({"backward_passes_per_step": 2},
                                                                             {"passes": 2, "lanes": True}),
                "two lanes, graph change": ({}, {"skip_rank": 1, "lanes": True}),
                "shared memory": ({}, {"shm": True}), "in place, shared memory": ({}, {"in_place": True, "shm": True}),
                "graph change, shared memory": ({}, {"skip_rank": 1, "shm": True})}
    for name, (options, how) in settings.items():
        record["cases"][name] = {path: train(path, options, **how) for path in ("direct", "horovod")}
    record["two optimizers"] = {path: two_optimizers(path) for path in ("direct", "horovod")}
    record["calls"] = calls()
    record["quiet setting"] = quiet_setting()
    record["large calls"] = large_calls()
    record["shared memory"] = shared_memory_calls()
    write(hvdp.rank(), record)


def quiet_setting() -> Dict[str, Any]:
    """HVDP_QUIET_LOOP_MS's values, and a job cycle as long as the quiet spacing, which leaves the loop alone."""
    try:
        direct_allreduce.quiet_ms_from("fast")
        refused = ""
    except ValueError as error:
        refused = str(error)
    direct_allreduce.quiet_loop(False)
    os.environ["HOROVOD_CYCLE_TIME"], cycle = "50", os.environ.get("HOROVOD_CYCLE_TIME")
    direct_allreduce.quiet_loop(True)
    quiet_with_long_cycle = direct_allreduce.is_quiet()
    if cycle is None:
        del os.environ["HOROVOD_CYCLE_TIME"]
    else:
        os.environ["HOROVOD_CYCLE_TIME"] = cycle
    return {"unset": direct_allreduce.quiet_ms_from(None), "zero": direct_allreduce.quiet_ms_from(" 0"),
            "refused": refused, "quiet with a 50 ms cycle": quiet_with_long_cycle}


if __name__ == "__main__":
    main()
