"""A few steps of data-parallel training among a group of ranks, checked against one process.

Every member starts from different weights, ``broadcast_state`` makes them the
first member's, and each member trains on its own data. The result must equal
one process training on the union of the members' batches (mean loss), which
it can only do if the gradients were averaged over exactly the group's members.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import _report
import numpy as np

import hvdp

STEPS = 5
BATCH = 32


def batch(rank: int, step: int) -> tuple:
    """Rank ``rank``'s data for ``step`` (any rank can make any other rank's)."""
    rng = np.random.default_rng([rank, step])
    return rng.normal(size=(BATCH, 8)).astype(np.float32), rng.integers(0, 3, size=BATCH)


def union(members: List[int], step: int) -> tuple:
    parts = [batch(r, step) for r in members]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def train(framework: str, process_set: Optional[hvdp.ProcessSet] = None, optimizer: str = "sgd",
          shard: bool = False) -> Dict[str, Any]:
    """Train among ``process_set`` (None: every hvdp rank) with SGD+momentum or Adam; report what the test compares.

    ``shard``: torch only, with ``shard_optimizer_state=True`` (the report adds this rank's state elements).
    """
    members = list(process_set.ranks) if process_set is not None else list(range(hvdp.size()))
    seed = 1000 * (members[0] + 1) + hvdp.rank()  # different weights on every rank before broadcast_state
    if framework == "torch":
        return _torch(seed, members, process_set, optimizer, shard)
    return _keras(seed, members, process_set, optimizer)


def _summary(before: np.ndarray, after_broadcast: np.ndarray, trained: np.ndarray,
             reference: np.ndarray, losses: List[float]) -> Dict[str, Any]:
    return {"digest_before_broadcast": _report.digest(before),
            "digest_after_broadcast": _report.digest(after_broadcast), "digest": _report.digest(trained),
            "params": trained.astype(float).tolist(),
            "changed": float(np.max(np.abs(trained - after_broadcast))),
            "vs_single_process": float(np.max(np.abs(trained - reference))), "losses": losses}


def _torch(seed: int, members: List[int], process_set: Optional[hvdp.ProcessSet], optimizer: str,
           shard: bool) -> Dict[str, Any]:
    import torch

    def make_opt(params: Any) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01)

    def flat(module: torch.nn.Module) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy().copy()

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = hvdp.DistributedOptimizer(make_opt(model.parameters()), model, process_set=process_set,
                                    shard_optimizer_state=shard)
    before = flat(model)
    hvdp.broadcast_state(model, opt, process_set=process_set)
    after_broadcast = flat(model)
    reference = copy.deepcopy(model)
    ref_opt = make_opt(reference.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(hvdp.rank(), step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ux, uy = union(members, step)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(torch.from_numpy(ux)), torch.from_numpy(uy)).backward()
        ref_opt.step()
    hvdp.check_consistency(model, process_set=process_set)
    summary = _summary(before, after_broadcast, flat(model), flat(reference), losses)
    if shard:  # this rank's part of Adam's moments, and the whole state gathered from the set
        summary["state_elements"] = sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim())
        summary["whole_steps"] = sorted({int(s["step"]) for s in opt.state_dict()["state"].values()})
    return summary


def _keras(seed: int, members: List[int], process_set: Optional[hvdp.ProcessSet], optimizer: str) -> Dict[str, Any]:
    import keras

    def make_opt() -> Any:
        return keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "sgd" else keras.optimizers.Adam(0.01)

    def make() -> Any:
        return keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(16, activation="tanh"),
                                 keras.layers.Dense(3)])

    def flat(model: Any) -> np.ndarray:
        return np.concatenate([np.asarray(w).reshape(-1) for w in model.get_weights()])

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(seed)
    model = make()
    opt = hvdp.DistributedOptimizer(make_opt(), process_set=process_set)
    model.compile(optimizer=opt, loss=loss_fn)
    before = flat(model)
    hvdp.broadcast_state(model, opt, process_set=process_set)
    after_broadcast = flat(model)
    reference = make()
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=make_opt(), loss=loss_fn)
    losses = []
    for step in range(STEPS):
        losses.append(float(model.train_on_batch(*batch(hvdp.rank(), step))))
        reference.train_on_batch(*union(members, step))
    hvdp.check_consistency(model, process_set=process_set)
    return _summary(before, after_broadcast, flat(model), flat(reference), losses)


def fit_keras(process_set: hvdp.ProcessSet) -> Dict[str, Any]:
    """model.fit among ``process_set`` with hvdp's Keras callbacks; the digest and the logged losses."""
    import keras

    keras.utils.set_random_seed(hvdp.rank())  # different weights on every rank until the callback
    model = keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(4), keras.layers.Dense(3)])
    model.compile(optimizer=hvdp.DistributedOptimizer(keras.optimizers.SGD(0.05), process_set=process_set),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batch(hvdp.rank(), 99)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        hvdp.keras.BroadcastInitialState(process_set=process_set), hvdp.keras.MetricAverage(process_set=process_set)])
    weights = np.concatenate([np.asarray(w).reshape(-1) for w in model.get_weights()])
    return {"fit_digest": _report.digest(weights), "fit_losses": [float(v) for v in history.history["loss"]]}
