"""The GPU checks of scripts/gpu-check.sh, run under ``hvdp run -np 1 --framework torch``.

    gpu_check.py steptime    [--device cuda]  hvdp's DistributedOptimizer vs plain torch and DDP (NCCL), ms
                                              per step; a 64 MB allreduce, hvdp vs torch.distributed
    gpu_check.py equivalence [--device cuda]  what one device can prove: every DistributedOptimizer
                                              option against one process stepping without hvdp,
                                              collectives on device tensors, SyncBatchNorm, and
                                              (with HOROVOD_TIMELINE set) which Horovod operations ran

``--device cpu`` runs the same code without a GPU (the dry run of gpu-check.sh). Every figure is
printed; a line ``FAIL ...`` and exit status 1 for each check that does not hold.

At np=1 Horovod's DistributedOptimizer registers no gradient hooks (horovod/torch/optimizer.py:
only when size() > 1), so it reduces nothing: its step time is the wrapper's cost, and its
equivalence is exact. What goes through NCCL on one GPU is measured and checked separately: the
same training with every gradient reduced by Horovod's grouped allreduce (plain and fp16-compressed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

import hvdp

Batch = Tuple[torch.Tensor, torch.Tensor]
FAILURES: List[str] = []


def check(ok: bool, what: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILURES.append(what)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- models ------------------------------------------------------------------------------------
def mlp(seed: int = 0) -> torch.nn.Module:
    """The model of examples/train_digits.py: 64 -> 128 -> 10 (a step of a few kernels)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def cnn(seed: int = 0) -> torch.nn.Module:
    """A small image classifier (3x32x32, about 1.2 M parameters in 10 tensors)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(128, 256, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
        torch.nn.Flatten(), torch.nn.Linear(4096, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


MODELS: Dict[str, Tuple[Callable[[int], torch.nn.Module], Tuple[int, ...], int]] = {
    "mlp": (mlp, (64,), 32),          # builder, input shape, batch
    "cnn": (cnn, (3, 32, 32), 128),
}


def data(kind: str, steps: int, device: torch.device, batch: int = 0) -> List[Batch]:
    _, shape, default = MODELS[kind]
    gen = torch.Generator().manual_seed(7)
    n = batch or default
    return [(torch.randn((n, *shape), generator=gen).to(device),
             torch.randint(0, 10, (n,), generator=gen).to(device)) for _ in range(steps)]


# -- step time ---------------------------------------------------------------------------------
def timed_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: List[Batch],
                device: torch.device) -> float:
    """Seconds per step over ``batches`` (synchronized with the device at both ends)."""
    loss_fn = torch.nn.CrossEntropyLoss()
    sync(device)
    start = time.perf_counter()
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    sync(device)
    return (time.perf_counter() - start) / len(batches)


class AllreducedSGD(torch.optim.SGD):
    """SGD whose step first averages every gradient with Horovod's grouped allreduce (NCCL on GPUs)."""

    compression: Any = None

    def step(self, closure: Any = None) -> Any:
        import horovod.torch as hvd

        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        reduced = hvd.grouped_allreduce(grads, op=hvd.Average, name="gpu_check.grads",
                                        compression=self.compression or hvd.Compression.none)
        for grad, value in zip(grads, reduced):
            grad.copy_(value)
        return super().step(closure)


def process_group(device: torch.device) -> str:
    """torch.distributed's one-process group (NCCL on a GPU, Gloo on the CPU), for DDP and its allreduce."""
    import socket

    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return backend


def steptime(device: torch.device, rounds: int, steps: int) -> Dict[str, Dict[str, Any]]:
    results: Dict[str, Dict[str, Any]] = {}
    cycle = os.environ.get("HOROVOD_CYCLE_TIME", "Horovod's default, 1")
    ddp_name = f"DDP ({process_group(device)})"
    for kind in MODELS:
        build = MODELS[kind][0]
        contenders: Dict[str, Tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
        model = build(0).to(device)
        contenders["plain torch"] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        ddp = torch.nn.parallel.DistributedDataParallel(
            build(0).to(device), device_ids=[device.index] if device.type == "cuda" else None)
        contenders[ddp_name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
        model = build(0).to(device)
        wrapped = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model)
        hvdp.broadcast_state(model, wrapped)
        contenders["hvdp.DistributedOptimizer"] = (model, wrapped)
        model = build(0).to(device)
        contenders["grouped allreduce of the gradients"] = (
            model, AllreducedSGD(model.parameters(), lr=0.01, momentum=0.9))
        batches = data(kind, steps, device)
        for model, opt in contenders.values():  # warm-up: kernels, allocator, NCCL communicator
            timed_steps(model, opt, batches[:10], device)
        times: Dict[str, List[float]] = {name: [] for name in contenders}
        for _ in range(rounds):  # alternated, so drift hits all alike
            for name, (model, opt) in contenders.items():
                times[name].append(1e3 * timed_steps(model, opt, batches, device))
        medians = {name: statistics.median(values) for name, values in times.items()}
        base = medians["plain torch"]
        results[kind] = {"median_ms": medians, "rounds_ms": times, "cycle_time_ms": cycle,
                         "overhead_ms": {name: ms - base for name, ms in medians.items()}}
        print(f"step time {kind}, batch {MODELS[kind][2]}, on {device} (medians of {rounds} rounds of {steps} "
              f"steps; HOROVOD_CYCLE_TIME {cycle} ms):", flush=True)
        for name, ms in medians.items():
            print(f"     {name:<36} {ms:9.3f} ms/step  {ms - base:+8.3f} ms ({100 * (ms - base) / base:+6.1f} %)",
                  flush=True)
        ratio = medians["hvdp.DistributedOptimizer"] / medians[ddp_name]
        results[kind]["hvdp_over_ddp"] = ratio
        print(f"     hvdp / {ddp_name}: {ratio:.3f}", flush=True)
        check(all(np.isfinite(list(medians.values()))) and min(medians.values()) > 0,
              f"step time {kind}: every contender measured")
    return results


def allreduce_64mb(device: torch.device, calls: int) -> Dict[str, Any]:
    """A 64 MB float32 allreduce: hvdp's new tensor and out= against torch.distributed's in place (NCCL on a
    GPU), alternated call by call, median ms and the ratios of their bandwidths (peer time / hvdp time)."""
    import torch.distributed as dist

    backend = process_group(device)
    tensor = torch.ones(16 << 20, device=device)
    forms: Dict[str, Callable[[], Any]] = {
        "hvdp.allreduce": lambda: hvdp.allreduce(tensor, op="sum", name="gpu_check.64mb"),
        "hvdp.allreduce out=": lambda: hvdp.allreduce(tensor, op="sum", name="gpu_check.64mb.out", out=tensor),
        f"torch.distributed all_reduce ({backend})": lambda: dist.all_reduce(tensor)}
    times: Dict[str, List[float]] = {name: [] for name in forms}
    for call in range(calls + 3):  # the first 3 of each left out (communicators, allocations)
        for name, form in forms.items():
            sync(device)
            start = time.perf_counter()
            form()
            sync(device)
            if call >= 3:
                times[name].append(1e3 * (time.perf_counter() - start))
    medians = {name: statistics.median(values) for name, values in times.items()}
    peer = medians[f"torch.distributed all_reduce ({backend})"]
    print(f"allreduce 64 MB float32 on {device}, np={hvdp.size()} (medians of {calls} calls):", flush=True)
    for name, ms in medians.items():
        print(f"     {name:<36} {ms:9.3f} ms   bandwidth vs torch.distributed {peer / ms:6.3f}", flush=True)
    check(all(np.isfinite(list(medians.values()))), "allreduce 64 MB: every form measured")
    return {"median_ms": medians, "bandwidth_ratio": {name: peer / ms for name, ms in medians.items()}}


# -- equivalence -------------------------------------------------------------------------------
OPTIONS: Dict[str, Dict[str, object]] = {
    "average": {}, "sum": {"op": "sum"}, "bpps2": {"backward_passes_per_step": 2},
    "predivide": {"gradient_predivide_factor": 2.0}, "fp16": {"compression": "fp16"}, "adasum": {"op": "adasum"},
}


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy().astype(np.float64)


def make_opt(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def train(kind: str, opt_name: str, option: str, batches: List[Batch], device: torch.device,
          distributed: bool) -> np.ndarray:
    """Five steps; at np=1 the hvdp run and the plain one must take the same steps
    (bpps2: two half-batch backward passes summed; the reference sums them too)."""
    model = MODELS[kind][0](0).to(device)
    opt = make_opt(opt_name, model)
    if distributed:
        opt = hvdp.DistributedOptimizer(opt, model, **OPTIONS[option])  # type: ignore[arg-type]
        hvdp.broadcast_state(model, opt)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in batches:
        opt.zero_grad()
        if option == "bpps2":
            half = len(x) // 2
            loss_fn(model(x[:half]), y[:half]).backward()
            loss_fn(model(x[half:]), y[half:]).backward()
        else:
            loss_fn(model(x), y).backward()
        opt.step()
    return flat(model)


def compare(got: np.ndarray, ref: np.ndarray) -> Dict[str, Any]:
    diff = np.abs(got - ref)
    return {"max_abs": float(diff.max()), "close": bool(np.allclose(got, ref, rtol=1e-5, atol=1e-6))}


def equivalence(device: torch.device) -> Dict[str, object]:
    out: Dict[str, object] = {}
    if device.type == "cuda":  # the same kernels in both runs: no TF32, deterministic cuDNN
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    for kind in MODELS:
        batches = data(kind, 5, device, batch=32)
        start = flat(MODELS[kind][0](0))
        for opt_name in ("sgd", "adam"):
            for option in OPTIONS:
                key = f"{kind}/{opt_name}/{option}"
                try:
                    got = train(kind, opt_name, option, batches, device, distributed=True)
                except Exception as exc:  # reported: adasum needs MPI on GPUs
                    out[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    print(f"     {key}: raised {out[key]}", flush=True)
                    check(option == "adasum", f"{key} runs")
                    continue
                ref_option = "bpps2" if option == "bpps2" else "average"
                ref = train(kind, opt_name, ref_option, batches, device, distributed=False)
                result = compare(got, ref)
                result["moved"] = float(np.abs(got - start).max())
                if option == "fp16":
                    result["relative_l2"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                out[key] = result
                print(f"     {key}: max |hvdp - plain| {result['max_abs']:.3g}, moved {result['moved']:.3g}"
                      + (f", relative L2 {result['relative_l2']:.3g}" if option == "fp16" else ""), flush=True)
                check(result["moved"] > 1e-2, f"{key}: training moved the parameters")
                if option == "fp16":
                    check(result["relative_l2"] <= 1e-3, f"{key}: fp16 compression within 1e-3 (relative L2)")
                elif option != "adasum":
                    check(bool(result["close"]), f"{key}: equals plain torch (rtol 1e-5, atol 1e-6)")
    out["allreduced_training"] = allreduced_training(device)
    out["collectives"] = collectives(device)
    if device.type == "cuda":
        out["sync_batch_norm"] = sync_batch_norm(device)
    else:  # hvdp.SyncBatchNorm at np=1 hands CPU tensors to Horovod's, which takes GPU tensors only
        print("     SyncBatchNorm: skipped on the CPU (Horovod's SyncBatchNorm takes GPU tensors)", flush=True)
    return out


def allreduced_training(device: torch.device) -> Dict[str, object]:
    """Every gradient through Horovod's grouped allreduce (on a GPU: NCCL) vs plain SGD, 5 steps."""
    import horovod.torch as hvd

    out: Dict[str, object] = {}
    for kind in MODELS:
        batches = data(kind, 5, device, batch=32)
        loss_fn = torch.nn.CrossEntropyLoss()
        finals = {}
        for name, compression in (("plain", None), ("allreduce", hvd.Compression.none),
                                  ("allreduce_fp16", hvd.Compression.fp16)):
            model = MODELS[kind][0](0).to(device)
            if compression is None:
                opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            else:
                opt = AllreducedSGD(model.parameters(), lr=0.1, momentum=0.9)
                opt.compression = compression
            for x, y in batches:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
            finals[name] = flat(model)
        exact = compare(finals["allreduce"], finals["plain"])
        fp16 = float(np.linalg.norm(finals["allreduce_fp16"] - finals["plain"]) / np.linalg.norm(finals["plain"]))
        out[kind] = {"allreduce": exact, "fp16_relative_l2": fp16}
        print(f"     {kind}: gradients through grouped allreduce vs plain: max abs {exact['max_abs']:.3g}; "
              f"fp16-compressed: relative L2 {fp16:.3g}", flush=True)
        check(bool(exact["close"]), f"{kind}: allreduced gradients train as plain torch (rtol 1e-5, atol 1e-6)")
        check(fp16 <= 1e-3, f"{kind}: fp16-compressed allreduce within 1e-3 (relative L2)")
    return out


def collectives(device: torch.device) -> Dict[str, object]:
    x = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3)
    reduced = hvdp.allreduce(x, name="gpu.allreduce")
    summed = hvdp.allreduce(x, op="sum", name="gpu.allreduce.sum")
    gathered = hvdp.allgather(x, name="gpu.allgather")
    broadcast = hvdp.broadcast(x, root_rank=0, name="gpu.broadcast")
    half = hvdp.allreduce(x.half(), name="gpu.allreduce.half")
    out = {
        "devices": sorted({str(t.device) for t in (reduced, summed, gathered, broadcast, half)}),
        "allreduce": reduced.cpu().tolist(), "allgather_shape": list(gathered.shape),
        "broadcast": broadcast.cpu().tolist(), "half_dtype": str(half.dtype),
    }
    print(f"     collectives on {device}: {json.dumps(out)}", flush=True)
    check(out["devices"] == [str(x.device)], f"collectives return tensors on {x.device}")
    check(torch.equal(reduced, x) and torch.equal(summed, x) and torch.equal(broadcast, x)
          and torch.equal(gathered, x) and torch.equal(half, x.half()), "allreduce/allgather/broadcast values")
    hvdp.check_consistency(MODELS["mlp"][0](0).to(device))
    check(True, f"check_consistency on a model on {device}")
    return out


def sync_batch_norm(device: torch.device) -> Dict[str, object]:
    def build(norm: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 16), norm, torch.nn.ReLU(), torch.nn.Linear(16, 10)).to(device)
    model, ref = build(hvdp.SyncBatchNorm(16)), build(torch.nn.BatchNorm1d(16))
    opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in data("mlp", 5, device):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m(x), y).backward()
            o.step()
    result = compare(flat(model), flat(ref))
    print(f"     SyncBatchNorm vs BatchNorm1d on {device}: max abs {result['max_abs']:.3g}", flush=True)
    check(bool(result["close"]), "SyncBatchNorm equals BatchNorm1d at np=1")
    return result


def timeline_ops(path: Path) -> Dict[str, int]:
    """How often each Horovod activity (NCCL_ALLREDUCE, GLOO_ALLREDUCE, ...) began in the timeline."""
    counts: Dict[str, int] = {}
    if path.exists():
        for name in re.findall(r'"ph": "B", "name": "([A-Z0-9_]+)"', path.read_text(errors="replace")):
            counts[name] = counts.get(name, 0) + 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["steptime", "equivalence"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    hvdp.init()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL no GPU visible to torch (torch.cuda.is_available() is False)", flush=True)
        return 1
    device = torch.device("cuda", hvdp.local_rank()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)}, capability "
              f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}; torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} (torch's)",
              flush=True)
    print(f"hvdp: {hvdp.size()} process(es), framework {hvdp.framework()}, device {device}", flush=True)
    results: Dict[str, object] = {"device": str(device), "size": hvdp.size()}
    if args.check == "steptime":
        results["steptime"] = steptime(device, args.rounds, args.steps)
        results["allreduce_64mb"] = allreduce_64mb(device, calls=max(5, args.rounds * 4))
    else:
        results["equivalence"] = equivalence(device)
    hvdp.shutdown()
    timeline = os.environ.get("HOROVOD_TIMELINE")
    if timeline and args.check == "equivalence":
        ops = timeline_ops(Path(timeline))
        results["timeline_ops"] = ops
        print(f"     Horovod operations in the timeline: {json.dumps(ops, sort_keys=True)}", flush=True)
        expected = "NCCL_ALLREDUCE" if device.type == "cuda" else "ALLREDUCE"
        check(any(expected in name for name in ops), f"the timeline shows {expected}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True))
    print(f"{len(FAILURES)} check(s) failed" if FAILURES else "all checks passed", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
