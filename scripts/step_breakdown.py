"""Where one training step's time goes, on torch's two gradient paths, in one job (run it under hvdp run).

    hvdp run -np 2 --framework torch --timeline /tmp/steps.json scripts/step_breakdown.py [--model cnn] [--rounds 3]

Two copies of the bench's model (hvdp.bench), one optimizer on Horovod's path (HVDP_GRADIENT_PATH=horovod
as it is built) and one on the direct path (hvdp.backends.torch.direct.gradients), train alternately, ``--steps`` steps
each per round. Every step is split into forward, backward's own compute (the backward call less the
wait at its end), the hooks' Python (Horovod's per-gradient enqueue; the direct path's copy into its
bucket and hand-off), the wait at the end of backward for the reductions, and the optimizer's step.
With ``--timeline`` (Horovod's timeline, rank 0) Horovod's path's coordination (NEGOTIATE_ALLREDUCE) and
transport (GLOO_ALLREDUCE) per step come from it; the direct path's transport is the time its sender
thread spent in the Gloo calls. Rank 0 prints means per step (milliseconds: the phases add up to the step)
and the counts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.nn.functional as F  # noqa: N812

import hvdp
from hvdp.backends.torch import gradients
from hvdp.backends.torch.direct import allreduce as direct_allreduce
from hvdp.bench import breakdown, models
from hvdp.bench.torch_bench import build_model

PHASES = ("forward", "backward compute", "hooks", "wait at backward's end", "optimizer step", "step")


def build(path: str, model_name: str) -> Any:
    torch.manual_seed(0)
    model = build_model(model_name)
    os.environ[direct_allreduce.PATH_ENV] = path
    try:
        opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model)
    finally:
        del os.environ[direct_allreduce.PATH_ENV]
    hvdp.broadcast_state(model, opt)
    return model, opt


def instrument(opt: Any, path: str, clock: Dict[str, float]) -> None:
    """Add the hooks' and the transport's time to ``clock`` as they run."""

    def timed(function: Any, key: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            begun = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                clock[key] = clock.get(key, 0.0) + time.perf_counter() - begun
        return wrapper

    if path == "horovod":
        opt._allreduce_grad_async = timed(opt._allreduce_grad_async, "hooks")
        # the end of backward waits for each gradient's handle in gradients.wait
        gradients.wait = timed(gradients.wait, "wait")
    else:
        direct = opt.gradient_path
        direct.finish = timed(direct.finish, "wait")  # send the rest, wait, write .grad
        direct.hook = timed(direct.hook, "hooks")
        for p in direct.params:  # the hooks were registered bound: register the timed one in their place
            p._post_accumulate_grad_hooks.clear()
            p.register_post_accumulate_grad_hook(direct.hook)
        # the sender thread's Gloo calls (the class's: the thread took the instance when it started)
        direct_allreduce.DirectAllreduce.__call__ = timed(direct_allreduce.DirectAllreduce.__call__,  # type: ignore
                                                      "transport")


def timeline_per_step(path: str, steps: int) -> Dict[str, float]:
    """Horovod's path's coordination (negotiations) and transport per step, from rank 0's timeline (ms)."""
    parsed = breakdown.parse_timeline(open(path).read())
    totals = {"coordination (negotiation)": 0.0, "transport (GLOO_ALLREDUCE)": 0.0, "allreduces": 0.0}
    for name, calls in parsed.calls.items():
        if "hvdp." in name:  # hvdp's own collectives (broadcast_state, the plan's agreement), not a step's
            continue
        for call in calls:
            if call.negotiate:
                totals["coordination (negotiation)"] += (call.negotiate[1] - call.negotiate[0]) / 1000.0
            totals["transport (GLOO_ALLREDUCE)"] += sum(e - b for n, b, e in call.activities
                                                        if n in breakdown.TRANSPORT) / 1000.0
            totals["allreduces"] += 1
    return {k: v / steps for k, v in totals.items()}
    # (a negotiation spans from the first rank's request to the agreement: it overlaps backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", choices=models.MODELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    hvdp.init(framework="torch")
    torch.set_num_threads(1)
    x, y = models.synthetic_batches(args.model, 32, 4, seed=hvdp.rank())
    batches = [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in zip(x, y)]
    runs = {path: build(path, args.model) for path in ("horovod", "direct")}
    rows: Dict[str, List[Dict[str, float]]] = {path: [] for path in runs}
    timeline = os.environ.get("HOROVOD_TIMELINE")
    for round_ in range(args.rounds):
        for path, (model, opt) in runs.items():
            clock: Dict[str, float] = {}
            if round_ == 0:
                instrument(opt, path, clock)
            opt._hvdp_clock = clock if round_ == 0 else opt._hvdp_clock
            clock = opt._hvdp_clock
            for step in range(args.warmup + args.steps):
                xb, yb = batches[step % len(batches)]
                clock.clear()
                start = time.perf_counter()
                opt.zero_grad()
                out = model(xb)
                loss = F.cross_entropy(out, yb)
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
                opt.step()
                end = time.perf_counter()
                if step >= args.warmup:
                    wait = clock.get("wait", 0.0)
                    rows[path].append({"forward": forward - start, "backward compute": backward - forward - wait,
                                       "hooks": clock.get("hooks", 0.0), "wait at backward's end": wait,
                                       "optimizer step": end - backward, "step": end - start,
                                       "transport (sender)": clock.get("transport", 0.0)})
    counts = runs["direct"][1].gradient_path.counts
    if hvdp.rank() != 0:
        return
    print(f"{args.model}, np={hvdp.size()}, {args.rounds} rounds x {args.steps} steps per path, rank 0, "
          f"mean ms per step (direct path's counts: {counts})")
    print(f"{'phase':<28}{'Horovod path':>14}{'direct path':>14}")
    keys = [*PHASES, "transport (sender)"]
    for key in keys:
        cells = [statistics.fmean(r[key] for r in rows[path]) * 1e3 for path in ("horovod", "direct")]
        print(f"{key:<28}{cells[0]:>14.2f}{cells[1]:>14.2f}")
    if timeline:
        # Every Horovod op of the run is the Horovod path's (the direct path's steps run none after its first).
        total = args.rounds * (args.warmup + args.steps)
        print(f"Horovod's timeline, rank 0, per Horovod-path step (over its {total} steps):")
        for key, value in timeline_per_step(timeline, total).items():
            print(f"  {key:<30}{value:>10.2f}{'' if key == 'allreduces' else ' ms'}")


if __name__ == "__main__":
    main()
