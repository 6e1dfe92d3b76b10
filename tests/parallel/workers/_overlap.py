"""torch, ``shard_optimizer_state=True``: the buckets' reduce-scatters start inside backward; each rank's report.

Run by ``_sharded.run`` in the torch equivalence job (np=2), after ``small_chunks()`` (three buckets).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from _report import compare, digest, refusal
from _sharded import OPTIMIZERS, batches, flat, loss_of, make_model, reference, step_once, two_groups

import hvdp


def sharded(rank: int, opt_name: str = "sgd", model: Any = None, **options: Any) -> tuple:
    model = model or make_model(rank)
    opt = hvdp.DistributedOptimizer(OPTIMIZERS[opt_name](two_groups(model)), model, shard_optimizer_state=True,
                                    **options)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    hvdp.broadcast_state(model, opt)
    return model, opt, schedule


def early(rank: int, size: int) -> dict:
    """After backward() returns, every bucket is on its way, and the hooks sent all of them before its end."""
    model, opt, _ = sharded(rank)
    x, y = batches(1)[0]
    loss_of(model, x[rank::size], y[rank::size]).backward()
    reducer = opt._hvdp_shards.reducer
    found = {"buckets": len(reducer.buckets), "pending": len(reducer.pending), "early": reducer.early}
    opt.step()
    return found


def with_unused(rank: int) -> torch.nn.Module:
    """The test model with one more layer that forward never uses (no gradient: its bucket waits for the pass)."""
    model = make_model(rank)
    model.append(torch.nn.Linear(4, 3))
    model.forward = lambda x: model[2](model[1](model[0](x)))  # type: ignore[method-assign]
    return model


def unused(rank: int, size: int) -> dict:
    model, opt, schedule = sharded(rank, model=with_unused(rank))
    data = batches()
    sent_early = []
    for x, y in data:
        step_once(model, opt, x[rank::size], y[rank::size], "average")
        sent_early.append(opt._hvdp_shards.reducer.early)
        schedule.step()
    ref_model, _, _ = reference("sgd", "average", data, size, model=with_unused(0))
    return {**compare(flat(model), flat(ref_model)), "early": sent_early,
            "buckets": len(opt._hvdp_shards.reducer.buckets), "digest": digest(flat(model))}


def passes(rank: int, size: int, first_pass: Callable[[Any, Callable[[], None]], None]) -> dict:
    """Two backward passes a step, the first through ``first_pass(opt, backward)``, each on half the slice."""
    model, opt, schedule = sharded(rank, "adam")
    data = batches()
    for x, y in data:
        x, y = x[rank::size], y[rank::size]
        half = len(x) // 2
        opt.zero_grad()
        first_pass(opt, lambda x=x, y=y, half=half: loss_of(model, x[:half], y[:half]).backward())
        loss_of(model, x[half:], y[half:]).backward()
        opt.step()
        schedule.step()
    ref_model, _, _ = reference("adam", "bpps2", data, size)
    return {**compare(flat(model), flat(ref_model)), "digest": digest(flat(model))}


def in_no_sync(opt: Any, backward: Callable[[], None]) -> None:
    with opt.no_sync():
        backward()


def changed_after_backward(rank: int, size: int) -> dict:
    """A .grad changed after backward (a local clip, a replaced tensor) is refused at step(); the next step works."""
    model, opt, _ = sharded(rank)
    x, y = batches(1)[0]
    before = flat(model)
    out = {}
    changes = {"clip": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01),
               "replaced": lambda: setattr(model[2].bias, "grad", model[2].bias.grad.clone())}
    for name, change in changes.items():
        opt.zero_grad()
        loss_of(model, x[rank::size], y[rank::size]).backward()
        change()
        out[name] = refusal(opt.step)
    out["unchanged"] = bool((flat(model) == before).all())  # the refused steps changed nothing
    step_once(model, opt, x[rank::size], y[rank::size], "average")
    out["moved"] = float(abs(flat(model) - before).max())
    out["digest"] = digest(flat(model))
    return out


def run(rank: int, size: int) -> dict:
    return {"early": early(rank, size), "unused": unused(rank, size),
            "extra_pass": passes(rank, size, lambda opt, backward: backward()),
            "no_sync": passes(rank, size, in_no_sync),
            "changed": changed_after_backward(rank, size), "after": hvdp.allreduce(1.0, op="sum")}
