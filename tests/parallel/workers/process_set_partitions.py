"""Process sets as the README shows them, for partitions of 4 ranks: `python process_set_partitions.py FRAMEWORK`.

Every partition's sets are registered in hvdp.init(process_sets=...) (the static pattern);
then, partition after partition, each rank takes its set with hvdp.my_process_set, builds
a model from its own random weights, wraps Adam in DistributedOptimizer(process_set=),
broadcast_state(process_set=) and trains on its own data. The sets of a partition have
different sizes, so they finish at different times: ranks that are done must wait for the
others instead of ending the job under them.
"""

from __future__ import annotations

import sys

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
import _train

#: Two sets as in the README; three sets of sizes 1, 2 and 1 listed out of order with unsorted
#: ranks; sets of sizes 3 and 1 (the single rank finishes first and waits at exit).
PARTITIONS = {"two": [[0, 1], [2, 3]], "three": [[3], [2, 0], [1]], "three_and_one": [[3, 1, 2], [0]]}


def main() -> None:
    framework = sys.argv[1]
    sets = {name: [hvdp.ProcessSet(ranks) for ranks in partition] for name, partition in PARTITIONS.items()}
    hvdp.init(framework, process_sets=[ps for partition in sets.values() for ps in partition])
    record = {"rank": hvdp.rank(), "partitions": {}}
    for name, partition in sets.items():
        group = hvdp.my_process_set(partition)
        record["partitions"][name] = {"set": list(group.ranks), **_train.train(framework, group, optimizer="adam")}
    _report.write(hvdp.rank(), record)


if __name__ == "__main__":
    main()
