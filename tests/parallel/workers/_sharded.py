"""torch, ``shard_optimizer_state=True`` (ZeRO stage 1): each rank's report of the sharded checks.

Run inside the torch equivalence job (np=2) by :func:`run`, and at np=3 by
``sharded_resume.py`` (:func:`resume`), which continues from this job's checkpoint.
Every comparison is against one process stepping on the whole batch, computed on each rank.
"""

from __future__ import annotations

import os
from typing import Any, Dict

import numpy as np
import torch
from _report import compare, digest, refusal

import hvdp

STEPS, GLOBAL_BATCH, FEATURES, CLASSES = 5, 60, 16, 4  # 60: equal slices at 2 and 3 ranks
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.01),
}
OPTIONS = {"average": {}, "sum": {"op": "sum"}, "bpps2": {"backward_passes_per_step": 2},
           "predivide": {"gradient_predivide_factor": 2.0}, "fp16": {"compression": "fp16"}}


def make_model(seed: int) -> torch.nn.Module:
    """33 hidden units: the flat buffer (697 + 96 elements) divides by neither 2 nor 3."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 33), torch.nn.Tanh(), torch.nn.Linear(33, CLASSES))


def batches(steps: int = STEPS, seed: int = 7) -> list:
    data = np.random.default_rng(seed)
    return [(torch.from_numpy(data.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)),
             torch.from_numpy(data.integers(0, CLASSES, size=GLOBAL_BATCH))) for _ in range(steps)]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype(np.float64)


def two_groups(model: torch.nn.Module) -> list:
    """Two param groups with their own learning rates: the per-group hyperparameters are kept."""
    return [{"params": model[0].parameters()},
            {"params": [p for layer in list(model)[2:] for p in layer.parameters()], "lr": 0.05}]


def step_once(model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, option: str,
              clip: float = 0.0) -> Any:
    """One step on this rank's slice (the optimizer averages or sums over the ranks)."""
    opt.zero_grad()
    if option == "bpps2":
        half = len(x) // 2
        loss_of(model, x[:half], y[:half]).backward()
        loss_of(model, x[half:], y[half:]).backward()
    else:
        loss_of(model, x, y).backward()
    norm = None
    if clip:
        norm = opt.clip_grad_norm_(clip) if hasattr(opt, "clip_grad_norm_") else \
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return norm


def reference(opt_name: str, option: str, data: list, size: int, clip: float = 0.0, model: Any = None) -> tuple:
    """One process on the whole batch: the loss summed over the ranks' slices (averaged but for op='sum')."""
    model = model or make_model(0)
    opt = OPTIMIZERS[opt_name](two_groups(model))
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    norms = []
    for x, y in data:
        opt.zero_grad()
        scale = 1.0 if option == "sum" else float(size)
        if option == "bpps2":
            half = GLOBAL_BATCH // size // 2
            loss = sum(loss_of(model, x[r::size][:half], y[r::size][:half]) +
                       loss_of(model, x[r::size][half:], y[r::size][half:]) for r in range(size)) / scale
        else:
            loss = sum(loss_of(model, x[r::size], y[r::size]) for r in range(size)) / scale
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        schedule.step()
    return model, opt, norms


def sharded_run(opt_name: str, option: str, data: list, rank: int, size: int, shard: bool = True,
                clip: float = 0.0) -> tuple:
    model = make_model(rank)  # different weights until broadcast_state gives every rank rank 0's
    opt = hvdp.DistributedOptimizer(OPTIMIZERS[opt_name](two_groups(model)), model, shard_optimizer_state=shard,
                                    **OPTIONS[option])
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # made after wrapping, as usual
    hvdp.broadcast_state(model, opt)
    norms = []
    for x, y in data:
        norm = step_once(model, opt, x[rank::size], y[rank::size], option, clip)
        if norm is not None:
            norms.append(float(norm))
        schedule.step()
    return model, opt, norms


def state_elements(opt: Any) -> int:
    """Elements of the optimizer's state tensors on this rank (moments, momentum buffers; not counters)."""
    return sum(v.numel() for entry in opt.state.values() for v in entry.values() if torch.is_tensor(v) and v.dim())


def state_difference(whole: Dict[str, Any], ref: Dict[str, Any]) -> float:
    """Largest difference between two torch optimizer state_dicts' tensors (inf if their keys differ)."""
    if set(whole["state"]) != set(ref["state"]):
        return float("inf")
    worst = 0.0
    for index, entry in ref["state"].items():
        if set(entry) != set(whole["state"][index]):
            return float("inf")
        for key, value in entry.items():
            got = whole["state"][index][key]
            worst = max(worst, float(torch.as_tensor(got, dtype=torch.float64).sub(
                torch.as_tensor(value, dtype=torch.float64)).abs().max()))
    return worst


def equivalence(rank: int, size: int) -> dict:
    data, out = batches(), {}
    whole_elements = sum(p.numel() for p in make_model(0).parameters())
    for opt_name in OPTIMIZERS:
        for option in OPTIONS:
            model, opt, _ = sharded_run(opt_name, option, data, rank, size)
            ref_model, ref_opt, _ = reference(opt_name, "average" if option in ("predivide", "fp16") else option,
                                              data, size)
            got, ref = flat(model), flat(ref_model)
            result = {**compare(got, ref), "digest": digest(got),
                      "moved": float(np.max(np.abs(got - flat(make_model(0))))),
                      "state_elements": state_elements(opt), "whole_elements": whole_elements,
                      "lrs": [group["lr"] for group in opt.param_groups]}
            if option == "fp16":  # against the unsharded optimizer with the same compression
                plain, _, _ = sharded_run(opt_name, option, data, rank, size, shard=False)
                result["fp16_vs_unsharded"] = compare(got, flat(plain))
                result["relative_l2"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            if option == "average":
                result["state_max_abs"] = state_difference(opt.state_dict(), ref_opt.state_dict())
            out[f"{opt_name}/{option}"] = result
    model, _, norms = sharded_run("sgd", "average", data, rank, size, clip=0.05)
    ref_model, _, ref_norms = reference("sgd", "average", data, size, clip=0.05)
    out["clip"] = {**compare(flat(model), flat(ref_model)), "norms": norms, "ref_norms": ref_norms,
                   "digest": digest(flat(model))}
    return out


def checkpoints(rank: int, size: int) -> dict:
    """Sharded -> file -> unsharded, unsharded -> file -> sharded, each continued: one 10-step run's end."""
    folder, data, out = os.environ["HVDP_TEST_OUT"], batches(2 * STEPS), {}
    first, rest = data[:STEPS], data[STEPS:]
    ref_model, _, _ = reference("adam", "average", data, size)
    for saved, loaded in ((True, False), (False, True), (True, True)):
        model, opt, _ = sharded_run("adam", "average", first, rank, size, shard=saved)
        path = os.path.join(folder, f"adam_{'sharded' if saved else 'whole'}.ckpt")
        hvdp.save_checkpoint(path, model, opt, step=STEPS)
        fresh = make_model(100 + rank)
        again = hvdp.DistributedOptimizer(OPTIMIZERS["adam"](two_groups(fresh)), fresh, shard_optimizer_state=loaded)
        schedule = torch.optim.lr_scheduler.StepLR(again, step_size=2, gamma=0.5)
        extras = hvdp.load_checkpoint(path, fresh, again)
        schedule.last_epoch = STEPS  # where the saved run's stood (the param groups hold its lr)
        for x, y in rest:
            step_once(fresh, again, x[rank::size], y[rank::size], "average")
            schedule.step()
        out[f"{'sharded' if saved else 'whole'}_to_{'sharded' if loaded else 'whole'}"] = {
            **compare(flat(fresh), flat(ref_model)), "digest": digest(flat(fresh)), "extras": extras,
            "state_elements": state_elements(again)}
    # In memory, no file: the gathered state_dict() into one plain torch optimizer, which continues alone on
    # the whole batch (each parameter must get a step counter of its own).
    model, opt, _ = sharded_run("adam", "average", first, rank, size)
    alone, alone_opt = continue_alone(model.state_dict(), opt.state_dict(), rest, size)
    out["state_dict_to_one_process"] = {**compare(flat(alone), flat(ref_model)), "extras": {"step": STEPS},
                                        "steps": sorted({int(e["step"]) for e in alone_opt.state.values()}),
                                        "state_elements": state_elements(alone_opt)}
    return out


def refusals(rank: int) -> dict:
    model = make_model(0)
    params = list(model.parameters())
    moved = make_model(0)
    opt = hvdp.DistributedOptimizer(torch.optim.SGD(moved.parameters(), lr=0.1), moved, shard_optimizer_state=True)
    moved[0].weight.data = moved[0].weight.data.clone()  # no longer a view of the optimizer's buffer

    def step_moved() -> None:
        loss_of(moved, torch.ones(2, FEATURES), torch.zeros(2, dtype=torch.long)).backward()
        opt.step()

    return {
        "lbfgs": refusal(lambda: hvdp.DistributedOptimizer(torch.optim.LBFGS(params), model,
                                                           shard_optimizer_state=True)),
        "adasum": refusal(lambda: hvdp.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), model, op="adasum",
                                                            shard_optimizer_state=True)),
        "groups": refusal(lambda: hvdp.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), model, groups=2,
                                                            shard_optimizer_state=True)),
        "not_bool": refusal(lambda: hvdp.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), model,
                                                              shard_optimizer_state="yes")),
        "mixed_dtypes": refusal(lambda: hvdp.DistributedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2).double())],
                            lr=0.1), None, shard_optimizer_state=True)),
        "moved_parameter": refusal(step_moved),
        "join": refusal(lambda: hvdp.join(moved, opt)),
        "after": hvdp.allreduce(1.0, op="sum"),  # the job still works
    }


def grad_scaler(rank: int, size: int) -> dict:
    """AMP's GradScaler over sharded Adam, beside the unsharded optimizer in the same loop (unscale_, then each
    one's clip of the global gradient, step, update): at step 1 rank 1's last-layer gradient is inf, which only
    the rank owning that part of the buffer sees; every rank must skip that step and halve its scale."""
    out = {}
    for shard in (True, False):
        model = make_model(rank)
        opt = hvdp.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model, shard_optimizer_state=shard)
        hvdp.broadcast_state(model, opt)
        scaler = torch.amp.GradScaler("cpu")
        scales, skipped = [], None
        for i, (x, y) in enumerate(batches()):
            spoil = model[2].weight.register_hook(lambda g: torch.full_like(g, float("inf"))) \
                if i == 1 and rank == 1 else None
            before = flat(model)
            opt.zero_grad()
            scaler.scale(loss_of(model, x[rank::size], y[rank::size])).backward()
            if spoil is not None:
                spoil.remove()
            scaler.unscale_(opt)
            if shard:
                opt.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
            skipped = bool(np.array_equal(before, flat(model))) if i == 1 else skipped
        out["sharded" if shard else "unsharded"] = {"flat": flat(model), "scales": scales, "skipped": skipped}
    sharded, whole = out["sharded"], out["unsharded"]
    return {**compare(sharded["flat"], whole["flat"]), "scales": [sharded["scales"], whole["scales"]],
            "skipped": [sharded["skipped"], whole["skipped"]], "digest": digest(sharded["flat"])}


def small_chunks() -> None:
    """Parts in chunks of 100 elements, so that a rank's part of the 561-element group is several parameters
    of the optimizer (and the 136-element group one), as a large model's are; and buckets of 30 elements, so
    that the first group's two tensors are a bucket each (and the second group's one), sent one by one as
    backward makes them, each split over the ranks on its own."""
    from hvdp.backends.torch import buckets, sharded

    sharded.CHUNK = 100
    buckets.FIRST = buckets.BUCKET = 30


def run(rank: int, size: int) -> dict:
    small_chunks()
    import _overlap

    return {"equivalence": equivalence(rank, size), "checkpoints": checkpoints(rank, size),
            "grad_scaler": grad_scaler(rank, size), "refusals": refusals(rank), "overlap": _overlap.run(rank, size)}


def resume(rank: int, size: int, path: str) -> dict:
    """Load a checkpoint (saved at another number of ranks) into a sharded Adam at ``size`` ranks and continue:
    the model one process reaches continuing from the same file on the whole batch."""
    small_chunks()
    rest = batches(2 * STEPS)[STEPS:]
    ref_model = continued_reference(path, rest, size)
    model = make_model(100 + rank)
    opt = hvdp.DistributedOptimizer(OPTIMIZERS["adam"](two_groups(model)), model, shard_optimizer_state=True)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    extras = hvdp.load_checkpoint(path, model, opt)
    schedule.last_epoch = STEPS
    loaded_steps = sorted({int(entry["step"]) for entry in opt.state_dict()["state"].values()})
    for x, y in rest:
        step_once(model, opt, x[rank::size], y[rank::size], "average")
        schedule.step()
    return {**compare(flat(model), flat(ref_model)), "digest": digest(flat(model)), "extras": extras,
            "moved": float(np.max(np.abs(flat(model) - flat(continued_reference(path, [], size))))),
            "state_elements": state_elements(opt), "whole_elements": sum(p.numel() for p in model.parameters()),
            "loaded_steps": loaded_steps}


def continued_reference(path: str, data: list, size: int) -> torch.nn.Module:
    """One process continuing from the file's model and optimizer state on the whole batch (``size`` slices)."""
    from hvdp import checkpoint

    arrays, state, _ = checkpoint.read(path, "torch")
    model, _ = continue_alone({name: torch.from_numpy(np.array(a)) for name, a in arrays.items()}, _tensors(state),
                              data, size)
    return model


def continue_alone(weights: Dict[str, Any], state: Dict[str, Any], data: list, size: int) -> tuple:
    """One process from ``weights`` and a whole optimizer ``state`` saved after STEPS steps, stepping on the
    whole batch of ``data`` (``size`` slices, their losses averaged): (model, optimizer)."""
    model = make_model(0)
    model.load_state_dict(weights)
    opt = OPTIMIZERS["adam"](two_groups(model))
    opt.load_state_dict(state)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    schedule.last_epoch = STEPS
    for x, y in data:
        opt.zero_grad()
        (sum(loss_of(model, x[r::size], y[r::size]) for r in range(size)) / size).backward()
        opt.step()
        schedule.step()
    return model, opt


def _tensors(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _tensors(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tensors(value) for value in tree)
    return torch.from_numpy(np.array(tree)) if isinstance(tree, np.ndarray) else tree
