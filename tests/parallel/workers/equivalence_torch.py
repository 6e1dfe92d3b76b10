"""torch: N replicas on N slices of a batch take the step one process takes on the whole batch.

Every rank also runs the single-process reference itself (no collectives), so
each rank reports its own comparison. Plus: sparse gradients, parameters
without gradients, SyncBatchNorm, check_consistency, the other collectives and
bad input.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable

import numpy as np
import torch

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
import _sharded
from _report import compare, digest

STEPS, GLOBAL_BATCH, FEATURES, CLASSES = 5, 64, 16, 4
OPTIONS = {
    "average": {},
    "sum": {"op": "sum"},
    "bpps2": {"backward_passes_per_step": 2},
    "fp16": {"compression": "fp16"},
    "adasum": {"op": "adasum"},
    "predivide": {"gradient_predivide_factor": 2.0},
    "groups2": {"groups": 2},  # the gradients in two requests
}


def make_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, CLASSES))
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 4, 4)), torch.nn.Conv2d(1, 6, 3, padding=1),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(96, CLASSES))


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def batches(size: int) -> list:
    data = np.random.default_rng(7)
    out = []
    for _ in range(STEPS):
        x = torch.from_numpy(data.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32))
        y = torch.from_numpy(data.integers(0, CLASSES, size=GLOBAL_BATCH))
        out.append([(x[r::size], y[r::size]) for r in range(size)])  # slice r goes to rank r
    return out


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype(np.float64)


def distributed_run(kind: str, opt_name: str, option: str, data: list, rank: int) -> np.ndarray:
    model = make_model(kind, seed=rank)  # different weights on every rank until broadcast_state: rank 0's
    opt = hvdp.DistributedOptimizer(make_optimizer(opt_name, model), model, **OPTIONS[option])
    hvdp.broadcast_state(model, opt)
    for step in data:
        x, y = step[rank]
        opt.zero_grad()
        if option == "bpps2":
            half = len(x) // 2
            loss_of(model, x[:half], y[:half]).backward()
            loss_of(model, x[half:], y[half:]).backward()
        else:
            loss_of(model, x, y).backward()
        opt.step()
    return flat(model)


def reference_run(kind: str, opt_name: str, option: str, data: list, size: int) -> np.ndarray:
    """One process on the whole batch, with the loss that the option implies."""
    model = make_model(kind)
    opt = make_optimizer(opt_name, model)
    for step in data:
        opt.zero_grad()
        if option == "sum":
            loss = sum(loss_of(model, x, y) for x, y in step)
        elif option == "bpps2":
            half = len(step[0][0]) // 2
            loss = sum(loss_of(model, x[:half], y[:half]) + loss_of(model, x[half:], y[half:])
                       for x, y in step) / size
        else:
            loss = sum(loss_of(model, x, y) for x, y in step) / size
        loss.backward()
        opt.step()
    return flat(model)


def equivalence(rank: int, size: int, only: list | None = None) -> dict:
    """Every case, or those named in ``only`` ('mlp/sgd/average', ...)."""
    data = batches(size)
    results = {}
    for kind in ("mlp", "cnn"):
        for opt_name in ("sgd", "adam"):
            if only is not None and not any(case.startswith(f"{kind}/{opt_name}/") for case in only):
                continue
            ref_avg = reference_run(kind, opt_name, "average", data, size)
            for option in OPTIONS:
                if only is not None and f"{kind}/{opt_name}/{option}" not in only:
                    continue
                try:
                    got = distributed_run(kind, opt_name, option, data, rank)
                except ValueError as exc:  # adasum under Gloo: the test checks the message
                    results[f"{kind}/{opt_name}/{option}"] = {"error": str(exc)}
                    continue
                ref = ref_avg if option in ("fp16", "adasum", "predivide", "groups2") else \
                    reference_run(kind, opt_name, option, data, size)
                if option == "average":
                    uncompressed = got
                if option == "fp16":
                    worst = int(np.argmax(np.abs(got - uncompressed)))
                    results[f"{kind}/{opt_name}/fp16_vs_uncompressed"] = {
                        "max_abs": float(np.abs(got - uncompressed)[worst]), "at_value": float(uncompressed[worst]),
                        "relative_l2": float(np.linalg.norm(got - uncompressed) / np.linalg.norm(uncompressed))}
                results[f"{kind}/{opt_name}/{option}"] = {
                    **compare(got, ref), "digest": digest(got),
                    "moved": float(np.max(np.abs(got - flat(make_model(kind))))),
                }
    return results


def step_forms(rank: int, size: int) -> dict:
    """The step forms of DDP and Horovod scripts: each equals one process on the whole batch.

    Gradients are averaged when ``backward()`` returns, so whatever runs between
    ``backward()`` and ``step()`` (clipping, AMP's unscale) sees the global gradient.
    """
    data, max_norm = batches(size), 0.1  # well below the gradients' norm: every step clips
    out: dict = {}

    def run(form: str, distributed: bool) -> tuple:
        model = make_model("cnn", seed=rank if distributed else 0)
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if distributed:
            opt = hvdp.DistributedOptimizer(base, model, **({"op": "sum"} if form == "horovod_sum" else {}))
            hvdp.broadcast_state(model, opt)
        else:
            opt = base
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if form == "amp" else None
        seen = {"norms": [], "grads_equal_after_backward": [], "local_inside_no_sync": []}
        for step in data:
            parts = [step[rank]] if distributed else step
            opt.zero_grad()
            if form == "no_sync":
                for x, y in parts:
                    half = len(x) // 2
                    context = opt.no_sync() if distributed else contextlib.nullcontext()
                    with context:
                        (loss_of(model, x[:half], y[:half]) / (1 if distributed else size)).backward()
                    if distributed:
                        seen["local_inside_no_sync"].append(grad_digest(model))
                    (loss_of(model, x[half:], y[half:]) / (1 if distributed else size)).backward()
            else:
                scale = 1 if form == "horovod_sum" else (1 if distributed else size)
                loss = sum(loss_of(model, x, y) for x, y in parts) / scale
                (scaler.scale(loss) if scaler else loss).backward()
            if distributed:
                seen["grads_equal_after_backward"].append(grad_digest(model))
            if scaler:
                scaler.unscale_(opt)
            if form == "horovod_sum" and distributed:
                opt.synchronize()  # Horovod's form: reduced once, never twice
            if form != "no_sync":
                seen["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            if scaler:
                scaler.step(opt)
                scaler.update()
            elif form == "horovod_sum" and distributed:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        return flat(model), seen

    for form in ("clip", "horovod_sum", "amp", "no_sync"):
        got, seen = run(form, True)
        ref, ref_seen = run(form, False)
        out[form] = {**compare(got, ref), "digest": digest(got), "norms": seen["norms"],
                     "ref_norms": ref_seen["norms"], "grads": seen["grads_equal_after_backward"],
                     "local": seen["local_inside_no_sync"]}
    return out


def grad_digest(model: torch.nn.Module) -> str:
    return digest(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy())


def drift_guard(rank: int, size: int) -> dict:
    """Each way replicas part, with its fix left out, stops at the guard's next check (every 2 steps here)."""
    out = {}
    for case in ("no_broadcast", "rank_only_update", "off"):
        model = make_model("mlp", seed=rank if case in ("no_broadcast", "off") else 0)
        opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                        check_every=0 if case == "off" else 2)
        steps_taken = 0
        try:
            for i, step in enumerate(batches(size)):
                if case == "rank_only_update" and i == 2 and rank == 1:
                    with torch.no_grad():
                        model[2].bias[0] += 1e-6  # e.g. a rank-only helper touching the model
                x, y = step[rank]
                opt.zero_grad()
                loss_of(model, x, y).backward()
                opt.step()
                steps_taken += 1
            out[case] = {"raised": None, "steps": steps_taken}
        except hvdp.ReplicaMismatchError as exc:
            out[case] = {"raised": str(exc), "steps": steps_taken}
    return out


def buffers(rank: int, size: int) -> dict:
    """BatchNorm's running statistics: rank 0's before each training forward (DDP's default), or per rank."""
    out = {}
    for choice in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, CLASSES))
        opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, broadcast_buffers=choice)
        for step in batches(size):
            x, y = step[rank]
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
        with torch.no_grad():  # one more training forward, on the same input on every rank
            model(torch.ones(4, FEATURES))
        out[str(choice)] = digest(np.concatenate([b.numpy().astype(np.float64).ravel() for b in model.buffers()]))
    return out


def uneven(rank: int, size: int) -> dict:
    """hvdp.join: rank r has STEPS - r batches; a rank that ran out adds zeros and averages divide by
    size (DDP's Join). The guard checks every step, also while rank 1 waits in the join."""
    counts = [STEPS - r for r in range(size)]
    data = batches(size)

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, CLASSES))

    model = build(seed=rank)
    opt = hvdp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model, check_every=1)
    hvdp.broadcast_state(model, opt)
    start = {key: value.clone() for key, value in model.state_dict().items()}
    with hvdp.join(model, opt) as block:
        for step in data[:counts[rank]]:
            x, y = step[rank]
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()

    def reference(divisor: Callable[[int], int]) -> np.ndarray:  # one process, the same start
        ref = build(seed=0)
        ref.load_state_dict(start)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        for k, step in enumerate(data[:max(counts)]):
            stepping = [r for r in range(size) if k < counts[r]]
            total = [torch.zeros_like(p) for p in ref.parameters()]
            for r in stepping:
                ref.zero_grad()
                loss_of(ref, *step[r]).backward()
                total = [t + p.grad for t, p in zip(total, ref.parameters())]
            for t, p in zip(total, ref.parameters()):
                p.grad = t / divisor(len(stepping))
            ref_opt.step()
        return flat(ref)

    state = torch.cat([v.reshape(-1).double() for v in [*model.state_dict().values(),
                       *[t for s in opt.state_dict()["state"].values() for t in s.values()]]]).numpy()
    return {"last_rank": block.last_rank, "digest": digest(state),
            "adam_steps": [float(s["step"]) for s in opt.state_dict()["state"].values()][0],
            "vs_reference": compare(flat(model), reference(lambda stepping: size)),
            "vs_mean_of_stepping": compare(flat(model), reference(lambda stepping: stepping))}


def sparse_and_missing(rank: int, size: int) -> dict:
    out = {}
    # Sparse gradients from nn.Embedding(sparse=True).
    def embed_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(),
                                   torch.nn.Linear(24, CLASSES))
    data = np.random.default_rng(11)
    steps = [(torch.from_numpy(data.integers(0, 50, size=(2 * size, 3))), torch.from_numpy(
        data.integers(0, CLASSES, size=2 * size))) for _ in range(STEPS)]
    ref = embed_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in steps:
        ref_opt.zero_grad()
        (sum(loss_of(ref, x[r::size], y[r::size]) for r in range(size)) / size).backward()
        ref_opt.step()
    # the embedding's rows gathered (Horovod's default), reduced dense, and the head's two tensors in one group
    for key, options in (("sparse", lambda m: {}), ("sparse_as_dense", lambda m: {"sparse_as_dense": True}),
                         ("groups_lists", lambda m: {"groups": [[m[2].weight, m[2].bias]], "sparse_as_dense": True})):
        model = embed_model()
        opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, **options(model))
        for x, y in steps:
            opt.zero_grad()
            loss_of(model, x[rank::size], y[rank::size]).backward()
            opt.step()
        out[key] = {**compare(flat(model), flat(ref)), "digest": digest(flat(model))}
    sparse_groups = embed_model()
    out["sparse_groups_refused"] = _report.refusal(lambda: hvdp.DistributedOptimizer(
        torch.optim.SGD(sparse_groups.parameters(), lr=0.5), sparse_groups, groups=2))

    # A head that gets no gradient on some steps on some ranks.
    torch.manual_seed(0)
    trunk, head_a, head_b = torch.nn.Linear(FEATURES, 8), torch.nn.Linear(8, CLASSES), torch.nn.Linear(8, CLASSES)
    model = torch.nn.ModuleDict({"trunk": trunk, "a": head_a, "b": head_b})
    opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    start = time.perf_counter()
    for i, step in enumerate(batches(size)):
        x, y = step[rank]
        use_b = rank == 0 or i % 2 == 0
        opt.zero_grad()
        h = torch.tanh(trunk(x))
        loss = loss_of(head_a, h, y) + (loss_of(head_b, h, y) if use_b else 0.0)
        loss.backward()
        opt.step()
    out["missing_grads"] = {"seconds": time.perf_counter() - start, "digest": digest(flat(model))}
    return out


def sync_batch_norm(rank: int, size: int) -> dict:
    def build(norm: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(0)
        first, last = torch.nn.Linear(FEATURES, 8), torch.nn.Linear(8, CLASSES)
        return torch.nn.Sequential(first, norm, torch.nn.ReLU(), last)
    model = build(hvdp.SyncBatchNorm(8))
    ref = build(torch.nn.BatchNorm1d(8))
    converted = hvdp.convert_sync_batchnorm(build(torch.nn.BatchNorm1d(8)))  # DDP's way to the same model
    opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    converted_opt = hvdp.DistributedOptimizer(torch.optim.SGD(converted.parameters(), lr=0.1, momentum=0.9),
                                              converted)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in batches(size):
        x, y = step[rank]
        for trained, trained_opt in ((model, opt), (converted, converted_opt)):
            trained_opt.zero_grad()
            loss_of(trained, x, y).backward()
            trained_opt.step()
        ref_opt.zero_grad()
        whole_x, whole_y = torch.cat([s[0] for s in step]), torch.cat([s[1] for s in step])
        loss_of(ref, whole_x, whole_y).backward()
        ref_opt.step()
    stats = lambda m: np.concatenate([m[1].running_mean.numpy(), m[1].running_var.numpy()])  # noqa: E731
    model.eval()
    ref.eval()
    with torch.no_grad():  # evaluation uses the running statistics, on every rank's own batch
        x, _ = batches(size)[0][rank]
        evaluated = compare(model(x).numpy().astype(np.float64), ref(x).numpy().astype(np.float64))
    return {"params": compare(flat(model), flat(ref)), "running_stats": compare(stats(model), stats(ref)),
            "eval": evaluated, "class": type(model[1]).__name__,
            "converted": {"params": compare(flat(converted), flat(ref)),
                          "running_stats": compare(stats(converted), stats(ref)), **conversion()}}


def conversion() -> dict:
    """hvdp.convert_sync_batchnorm on nested BatchNorm layers of each kind: what it keeps and replaces."""
    inner = torch.nn.BatchNorm2d(4, momentum=0.3)
    with torch.no_grad():
        inner.running_mean.fill_(2.0)
        inner.weight.fill_(0.5)
    inner.eval()
    weight = inner.weight
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Sequential(inner, torch.nn.ReLU()),
                                torch.nn.Flatten(), torch.nn.BatchNorm1d(64, affine=False), torch.nn.Linear(64, 2))
    same = hvdp.convert_sync_batchnorm(model)
    converted = same[1][0]
    alone = hvdp.convert_sync_batchnorm(torch.nn.BatchNorm3d(2))
    return {"same_model": same is model, "classes": [type(m).__name__ for m in model.modules()],
            "kept": {"weight_object": converted.weight is weight, "running_mean": converted.running_mean.tolist(),
                     "momentum": converted.momentum, "training": converted.training,
                     "affine_off": same[3].weight is None},
            "alone": type(alone).__name__,
            "forward": list(same(torch.ones(2, 3, 6, 6)).shape)}


def consistency(rank: int) -> dict:
    model = make_model("mlp")
    hvdp.check_consistency(model)  # identical: must pass
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] += 1e-3
    try:
        hvdp.check_consistency(model)
        return {"raised": None}
    except hvdp.ReplicaMismatchError as exc:
        return {"raised": str(exc)}


def collectives(rank: int, size: int) -> dict:
    return {
        "allgather_tensor": hvdp.allgather(torch.full((rank + 1, 2), float(rank))).tolist(),
        "allgather_numpy": hvdp.allgather(np.array([rank], dtype=np.int32)).tolist(),
        "allgather_number": hvdp.allgather(rank * 10),
        "broadcast_tensor": hvdp.broadcast(torch.tensor([float(rank)] * 3), root_rank=1).tolist(),
        "broadcast_number": hvdp.broadcast(rank + 7, root_rank=0),
        "broadcast_object": hvdp.broadcast_object({"from": rank}, root_rank=1),
        "allgather_object": hvdp.allgather_object(("rank", rank)),
        "barrier": hvdp.barrier() is None,
    }


def bad_input(rank: int) -> dict:
    out = {}
    model = make_model("mlp")
    for case, call in {
        "optimizer_type": lambda: hvdp.DistributedOptimizer("sgd", model),
        "unknown_op": lambda: hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), op="mean"),
        "unknown_compression": lambda: hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1),
                                                                 compression="int8"),
        "shape_mismatch": lambda: hvdp.allreduce(torch.zeros(3 + rank), name="grad.w"),
        "dtype_mismatch": lambda: hvdp.allreduce(np.zeros(3, dtype=np.float32 if rank == 0 else np.float64),
                                                 name="grad.b"),
        "tape_on_torch": lambda: hvdp.DistributedGradientTape(None),
        "bf16": lambda: hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), compression="bf16"),
        "groups_zero": lambda: hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), groups=0),
        "groups_kind": lambda: hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), groups="all"),
    }.items():
        start = time.perf_counter()
        try:
            call()
            out[case] = {"type": None}
        except Exception as exc:  # the test checks the type and message
            out[case] = {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - start}
    out["after_errors"] = hvdp.allreduce(1.0, op="sum")  # the job still works
    return out


def main() -> None:
    hvdp.init()
    rank, size = hvdp.rank(), hvdp.size()
    only = os.environ.get("HVDP_EQUIVALENCE_ONLY")
    if only:  # a few cases at another size (test_equivalence's np=3 and np=6 jobs)
        _report.write(rank, {"rank": rank, "size": size,
                             "equivalence": equivalence(rank, size, only.split(","))})
        hvdp.shutdown()
        return
    record = {"rank": rank, "equivalence": equivalence(rank, size), **sparse_and_missing(rank, size),
              "sync_batch_norm": sync_batch_norm(rank, size),
              "step_forms": step_forms(rank, size), "drift_guard": drift_guard(rank, size),
              "buffers": buffers(rank, size), "uneven": uneven(rank, size),
              "consistency": consistency(rank),
              "collectives": collectives(rank, size), "bad_input": bad_input(rank),
              "sharded": _sharded.run(rank, size)}
    _report.write(rank, record)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
