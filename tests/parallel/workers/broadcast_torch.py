"""torch: broadcast_state leaves no trace, whatever the optimizer and whenever it is called.

Every rank builds its model from different random weights; rank 0's are the reference's.
* ``fresh``: wrap a new optimizer, broadcast_state, train on slices;
* ``resumed``: every rank first takes 2 steps of its own (so ranks hold different
  optimizer state), then wraps the optimizer, broadcast_state, trains on slices.
Either must equal one process on the whole batch that started from rank 0's weights
(and, resumed, rank 0's 2 steps), including the optimizer's own step counters.
Also: learning-rate schedulers bound before wrapping, through broadcast_state and a
checkpoint; broadcast_object/allgather_object with whatever each rank passes; a
checkpoint save that fails on rank 0.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
from _report import compare, digest

STEPS, PRE_STEPS, GLOBAL_BATCH, FEATURES, CLASSES = 5, 2, 32, 8, 3
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))


def data(step: int, size: int) -> list:
    """The whole batch of ``step``, as ``size`` slices (slice r is rank r's)."""
    rng = np.random.default_rng([7, step])
    x = torch.from_numpy(rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, CLASSES, size=GLOBAL_BATCH))
    return [(x[r::size], y[r::size]) for r in range(size)]


def own_data(rank: int, step: int) -> tuple:
    """What rank ``rank`` trains on alone before it joins the job (different on every rank)."""
    rng = np.random.default_rng([rank, 100 + step])
    return (torch.from_numpy(rng.normal(size=(8, FEATURES)).astype(np.float32)),
            torch.from_numpy(rng.integers(0, CLASSES, size=8)))


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype(np.float64)


def step_counters(opt: torch.optim.Optimizer) -> list:
    """Each parameter's step counter (None where the optimizer keeps none), in parameter order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            out.append(None if step is None else float(step))
    return out


def pre_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    for step in range(PRE_STEPS):
        x, y = own_data(rank, step)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


def run(name: str, resumed: bool, rank: int, size: int) -> dict:
    model = make_model(100 + rank)
    opt = OPTIMIZERS[name](model.parameters())
    if resumed:
        pre_steps(model, opt, rank)
    opt = hvdp.DistributedOptimizer(opt, model)
    hvdp.broadcast_state(model, opt)
    after_broadcast = step_counters(opt)
    for step in range(STEPS):
        x, y = data(step, size)[rank]
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    # The reference: one process, rank 0's start (and rank 0's own steps), the whole batch.
    ref = make_model(100)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    if resumed:
        pre_steps(ref, ref_opt, 0)
    ref_after_broadcast = step_counters(ref_opt)
    for step in range(STEPS):
        ref_opt.zero_grad()
        (sum(loss_of(ref, x, y) for x, y in data(step, size)) / size).backward()
        ref_opt.step()
    return {**compare(flat(model), flat(ref)), "digest": digest(flat(model)),
            "steps": step_counters(opt), "reference_steps": step_counters(ref_opt),
            "steps_after_broadcast": after_broadcast, "reference_steps_after_broadcast": ref_after_broadcast,
            "moved": float(np.max(np.abs(flat(model) - flat(make_model(100)))))}


def schedulers(rank: int, size: int, out_dir: str) -> dict:
    """StepLR and LambdaLR bound to the optimizer before it is wrapped, through broadcast_state and a checkpoint."""
    def build(seed: int) -> tuple:
        model = make_model(seed)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        return model, opt, [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
                            torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))]

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, scheds: list, steps: range,
              distributed: bool) -> None:
        for step in steps:
            opt.zero_grad()
            if distributed:
                loss_of(model, *data(step, size)[rank]).backward()
            else:
                (sum(loss_of(model, x, y) for x, y in data(step, size)) / size).backward()
            opt.step()
            for sched in scheds:
                sched.step()

    model, opt, scheds = build(100 + rank)
    train(model, opt, scheds, range(0, 3), distributed=False)  # every rank alone, from its own weights
    wrapped = hvdp.DistributedOptimizer(opt, model)
    hvdp.broadcast_state(model, wrapped)
    train(model, wrapped, scheds, range(3, 6), distributed=True)
    path = os.path.join(out_dir, "sched.npz")
    hvdp.save_checkpoint(path, model, wrapped, scheds=[s.state_dict() for s in scheds])
    train(model, wrapped, scheds, range(6, 9), distributed=True)
    uninterrupted = flat(model)
    lrs = [group["lr"] for group in wrapped.param_groups]

    resumed_model, resumed_opt, resumed_scheds = build(500 + rank)  # other weights, fresh schedulers
    resumed_wrapped = hvdp.DistributedOptimizer(resumed_opt, resumed_model)
    extras = hvdp.load_checkpoint(path, resumed_model, resumed_wrapped)
    for sched, state in zip(resumed_scheds, extras["scheds"]):
        sched.load_state_dict(state)
    train(resumed_model, resumed_wrapped, resumed_scheds, range(6, 9), distributed=True)

    ref, ref_opt, ref_scheds = build(100)
    train(ref, ref_opt, ref_scheds, range(0, 9), distributed=False)
    return {"vs_single_process": compare(uninterrupted, flat(ref)), "lrs": lrs,
            "reference_lrs": [group["lr"] for group in ref_opt.param_groups],
            "resumed_vs_uninterrupted": float(np.max(np.abs(flat(resumed_model) - uninterrupted))),
            "resumed_lrs": [group["lr"] for group in resumed_wrapped.param_groups],
            "groups_shared": wrapped.param_groups[0] is opt.param_groups[0] and wrapped.state is opt.state}


def objects(rank: int) -> dict:
    """broadcast_object/allgather_object called the usual ways: None off the root, other types, other sizes."""
    start = time.perf_counter()
    out = {
        "config": hvdp.broadcast_object({"lr": 0.1, "layers": [4, 8]} if rank == 0 else None),
        "from_rank_1": hvdp.broadcast_object("text" if rank == 1 else rank, root_rank=1),
        "big_vs_small": len(hvdp.broadcast_object(list(range(100000)) if rank == 0 else [rank])),
        "gathered": hvdp.allgather_object(None if rank == 0 else {"rank": rank, "pad": "x" * 1000 * rank}),
    }
    out["gathered"] = [g if g is None else g["rank"] for g in out["gathered"]]
    out["seconds"] = time.perf_counter() - start
    return out


def failing_saves(rank: int, out_dir: str) -> dict:
    """A save that fails on rank 0 raises CheckpointError on every rank, and the previous checkpoint survives."""
    model = make_model(1)
    opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    hvdp.broadcast_state(model, opt)
    good = os.path.join(out_dir, "good.npz")
    hvdp.save_checkpoint(good, model, opt, epoch=1)
    blocker = os.path.join(out_dir, "a_file")
    if rank == 0:
        with open(blocker, "w") as handle:
            handle.write("not a folder")
    hvdp.barrier()
    cases = {"parent_is_a_file": os.path.join(blocker, "x.npz"), "bad_extras": good}
    full = os.environ.get("HVDP_TEST_FULL_DIR")  # a 1 MB filesystem
    if full:
        hvdp.save_checkpoint(os.path.join(full, "small.npz"), model, opt, epoch=1)  # fits
        cases["disk_full"] = os.path.join(full, "small.npz")  # overwritten by a 4 MB model: no space
    readonly = os.environ.get("HVDP_TEST_READONLY_DIR")
    if readonly:
        cases["read_only_folder"] = os.path.join(readonly, "x.npz")
    out: dict = {}
    for case, path in cases.items():
        big = torch.nn.Linear(1000, 1000) if case == "disk_full" else model
        extras = {"epoch": object()} if case == "bad_extras" else {"epoch": 2}
        start = time.perf_counter()
        try:
            hvdp.save_checkpoint(path, big, None if big is not model else opt, **extras)
            out[case] = {"type": None}
        except Exception as exc:  # the test checks the type and message
            out[case] = {"type": type(exc).__name__, "message": str(exc)}
        out[case]["seconds"] = time.perf_counter() - start
    if full:
        out["previous_loads_after_full_disk"] = hvdp.load_checkpoint(cases["disk_full"], make_model(2), None)["epoch"]
    out["previous_loads"] = hvdp.load_checkpoint(good, make_model(2), None)["epoch"]
    folders = [out_dir] + ([full] if full else [])
    out["left_behind"] = sorted(f for folder in folders for f in os.listdir(folder)
                                if f.startswith(".") or "tmp" in f)
    return out


def main() -> None:
    hvdp.init()
    rank, size = hvdp.rank(), hvdp.size()
    out_dir = os.environ["HVDP_TEST_OUT"]
    record = {"rank": rank, "runs": {f"{name}/{when}": run(name, when == "resumed", rank, size)
                                     for name in OPTIMIZERS for when in ("fresh", "resumed")},
              "schedulers": schedulers(rank, size, out_dir), "objects": objects(rank),
              "failing_saves": failing_saves(rank, out_dir)}
    _report.write(rank, record)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
