"""Process sets on 4 ranks: `python process_sets.py FRAMEWORK static|dynamic` under mpirun or hvdp run.

Sets A = [0, 1] and B = [2, 3] each train their own model at the same time; C = [1, 2]
overlaps both and ALL = [0, 1, 2, 3] is the whole job. ``static`` registers the sets
in hvdp.init(process_sets=...) (the README's pattern), ``dynamic`` adds them after
hvdp.init(process_sets="dynamic"). Every rank reports the collectives it ran in its sets
and how misuse is refused.

Then three partitions of the job (A and B, and MORE_PARTITIONS), registered the same way:
partition after partition, each
rank takes its set with hvdp.my_process_set, builds a model from its own random weights, wraps
Adam in DistributedOptimizer(process_set=), broadcast_state(process_set=) and trains on its own
data. The sets of a partition have different sizes, so they finish at different times: ranks
that are done must wait for the others instead of ending the job under them.
"""

from __future__ import annotations

import sys

import numpy as np

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
import _train
from _report import refusal

#: Besides "two" (A and B themselves, as in the README): three sets of sizes 1, 2 and 1 listed out of
#: order with unsorted ranks; sets of sizes 3 and 1 (the single rank finishes first and waits at exit).
MORE_PARTITIONS = {"three": [[3], [2, 0], [1]], "three_and_one": [[3, 1, 2], [0]]}


def main() -> None:
    framework, mode = sys.argv[1], sys.argv[2]
    if mode == "static":
        a, b, c, everyone = (hvdp.ProcessSet(r) for r in ([0, 1], [3, 2], [1, 2], range(4)))
        more = {name: [hvdp.ProcessSet(ranks) for ranks in sets] for name, sets in MORE_PARTITIONS.items()}
        hvdp.init(framework, process_sets=[a, b, c, everyone, *(ps for sets in more.values() for ps in sets)])
    else:
        hvdp.init(framework, process_sets="dynamic")
        a, b = hvdp.add_process_set([0, 1]), hvdp.add_process_set(hvdp.ProcessSet([3, 2]))
        c, everyone = hvdp.add_process_set([1, 2]), hvdp.add_process_set(range(4))
        more = {name: [hvdp.add_process_set(ranks) for ranks in sets] for name, sets in MORE_PARTITIONS.items()}
    partitions = {"two": [a, b], **more}
    rank = hvdp.rank()
    mine = hvdp.my_process_set([a, b])
    other = b if mine is a else a
    record = {
        "rank": rank, "size": hvdp.size(), "mode": mode, "set": list(mine.ranks),
        "set_rank": mine.rank(), "set_size": mine.size(), "in_c": c.included(),
        "allreduce_sum": hvdp.allreduce(rank + 1, op="sum", process_set=mine),
        "allreduce_average": hvdp.allreduce(np.full(2, float(rank)), process_set=mine).tolist(),
        "allgather": hvdp.allgather(rank, process_set=mine),
        "broadcast_from_set_rank_1": hvdp.broadcast(rank * 10, root_rank=1, process_set=mine),
        "broadcast_object": hvdp.broadcast_object({"from": rank}, process_set=mine),
        "allgather_object": hvdp.allgather_object(f"r{rank}", process_set=mine),
        "shard": hvdp.shard(10, shuffle=False, process_set=mine).tolist(),
        "whole_job_sum": hvdp.allreduce(rank + 1, op="sum", process_set=everyone),
    }
    hvdp.barrier(process_set=mine)
    if c.included():  # the overlapping set, used by its members only
        record["c_sum"] = hvdp.allreduce(rank, op="sum", process_set=c)
    # A and B train a model each, at the same time, from different starting weights and data.
    record.update(_train.train(framework, mine))
    record.update(_train.fit_keras(mine))  # Keras 3 model.fit (on this framework) with hvdp's callbacks
    record["errors"] = {
        "foreign_set": refusal(lambda: hvdp.allreduce(1.0, process_set=other)),
        "overlapping_sets": refusal(lambda: hvdp.my_process_set([a, b, c])),
        "unregistered_set": refusal(lambda: hvdp.allreduce(1.0, process_set=hvdp.ProcessSet([0, 2]))),
        "ranks_not_a_set": refusal(lambda: hvdp.barrier(process_set=[0, 1])),
        "root_outside_set": refusal(lambda: hvdp.broadcast(1.0, root_rank=2, process_set=mine)),
        "set_rank_of_non_member": refusal(lambda: other.rank()),
        "rank_outside_job": refusal(lambda: hvdp.add_process_set([0, 4])),
        "add_twice": refusal(lambda: hvdp.add_process_set(mine)),
    }
    if mode == "static":
        record["errors"]["add_without_dynamic"] = refusal(lambda: hvdp.add_process_set([0, 3]))
        record["errors"]["remove_static"] = refusal(lambda: hvdp.remove_process_set(a))
    else:
        record["errors"]["add_existing_ranks"] = refusal(lambda: hvdp.add_process_set([1, 0]))
        # a set added, used, removed: then refused, and its ranks can be added again
        ends = hvdp.add_process_set([0, 3])
        removed = {"sum": hvdp.allreduce(rank + 1, op="sum", process_set=ends) if ends.included() else None}
        hvdp.remove_process_set(ends)
        removed["use_after"] = refusal(lambda: hvdp.allreduce(1.0, process_set=ends))
        removed["remove_twice"] = refusal(lambda: hvdp.remove_process_set(ends))
        again = hvdp.add_process_set([3, 0])
        removed["sum_again"] = hvdp.allreduce(rank + 1, op="sum", process_set=again) if again.included() else None
        record["removed"] = removed
    record["after_errors"] = hvdp.allreduce(1, op="sum")  # the job still works
    record["partitions"] = {}
    for name, partition in partitions.items():
        group = hvdp.my_process_set(partition)
        record["partitions"][name] = {"set": list(group.ranks), **_train.train(framework, group, optimizer="adam")}
        if framework == "torch":  # Adam's state sharded over the set's members
            record["partitions"][name]["sharded"] = _train.train(framework, group, optimizer="adam", shard=True)
    if framework == "torch":
        record["buffers"] = buffers_from_the_first_member(mine)
    _report.write(rank, record)
    hvdp.shutdown()


def buffers_from_the_first_member(group: hvdp.ProcessSet) -> list:
    """A BatchNorm (momentum 0: a forward keeps its running mean) trained in ``group``: before each forward
    the buffers come from the set's first member, which need not be rank 0 of the job."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, momentum=0.0))
    opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, process_set=group)
    hvdp.broadcast_state(model, opt, process_set=group)
    model[1].running_mean.fill_(float(hvdp.rank()))  # each member's own, after the broadcast
    opt.zero_grad()
    model(torch.ones(8, 4)).sum().backward()
    opt.step()
    return model[1].running_mean.tolist()


if __name__ == "__main__":
    main()
