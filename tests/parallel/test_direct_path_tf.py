"""TensorFlow's direct gradient path (one direct allreduce per dtype inside the traced step, where every rank's
gradients have the same layout: :mod:`hvdp.backends.tensorflow.direct`) against Horovod's path, in one np=2 job:
a traced and an eager DistributedGradientTape, average and sum, two dtypes in one update, sources that change on
every rank, and a float16 gradient (which keeps Horovod's path). Keras's model.fit on the direct path:
test_keras_backends.py; ranks whose models differ: test_faults.py (the stall names them), a stalled rank: there too.
"""

from __future__ import annotations

import pytest
from harness import max_abs_diff, run_worker

CASES = ("traced, average", "eager, sum", "traced, sources change", "traced, float16")
STEPS = 6


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_worker("direct_path_tf.py", "gloo", "tensorflow", tmp_path_factory.mktemp("direct_tf"))


@pytest.mark.parametrize("case", CASES)
def test_direct_path_matches_horovods_on_every_rank(job, case):
    digests = set()
    for r in job.ranks:
        direct, horovod = r["cases"][case]["direct"], r["cases"][case]["horovod"]
        assert max_abs_diff(direct["params"], horovod["params"]) <= 1e-6, (r["rank"], case)
        assert max(abs(v) for v in direct["params"]) > 0.1  # trained, not zeroed
        assert horovod["counts"] is None  # the switch: no direct group at all
        digests.add(direct["digest"])
        if case == "traced, float16":  # a gradient the direct op cannot take: every call on Horovod's path
            assert direct["counts"] == {"direct": 0, "horovod": STEPS, "differed": 0}, (r["rank"], direct["counts"])
            assert direct["quiet"] is False
        else:  # every call direct, from the first: the ranks compare their layouts at each call
            assert direct["counts"] == {"direct": STEPS, "horovod": 0, "differed": 0}, (r["rank"], direct["counts"])
            assert direct["quiet"] is True  # Horovod's loop quiet while the gradients go direct
        # traced: one tape per trace (two when the sources change); eager: one per step
        assert direct["tapes"] == {"eager, sum": STEPS, "traced, sources change": 2}.get(case, 1), direct["tapes"]
    assert len(digests) == 1, f"{case}: the replicas differ"


def test_a_collective_on_horovods_path_after_direct_steps_completes(job):
    for r in job.ranks:
        assert r["big"] == [3.0, 3.0], r["big"]
