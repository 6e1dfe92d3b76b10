"""The commands README.md and docs/*.md show in their shell blocks: each is run here, run by another test
(named, and checked to still mention it), or not run, with the reason; a block holding a
command that is not run says why in an HTML comment right above it.

Run here exactly as written (from the repository root or from a folder holding the files the
line names): the TensorFlow/MPI training line, ``--dry-run``, the elastic line (its
``train.py`` is the elastic block of docs/elastic.md itself), the two MPI-program lines (their
``my_mpi_program.py`` is the communicator block of docs/process-sets.md), and the profiler transcript
(with its ``/tmp/prof`` moved into the test's own folder).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from test_readme import NOT_RUN_MARK, REPO, Fence, fences, python_fences

VENV_BIN = Path(sys.executable).parent
TIMEOUT_S = 420

# --- what happens to each command ------------------------------------------------------------

#: run by a test of this file (the value names it)
HERE: Dict[str, str] = {
    "hvdp run -np 2 --framework tensorflow --mpi examples/train_digits.py --epochs 30":
        "test_tensorflow_mpi_training_line",
    "hvdp run -np 2 --framework torch --dry-run train.py": "test_dry_run_line",
    "hvdp run --elastic --min-np 1 --max-np 4 --host-discovery-script ./discover_hosts.sh --framework torch train.py":
        "test_elastic_line",
    "mpirun --allow-run-as-root --oversubscribe -np 4 .venv/bin/python my_mpi_program.py":
        "test_mpi_program_lines",
    "hvdp run -np 4 --mpi --framework torch my_mpi_program.py": "test_mpi_program_lines",
    "hvdp run -np 2 --framework torch --profile /tmp/prof tests/parallel/workers/profile_torch.py input_skew":
        "test_profile_transcript",
    "hvdp report /tmp/prof --plot docs/profile_report.png": "test_profile_transcript",
}

#: run by another test or by CI: (file, a string it must hold to still be running it)
ELSEWHERE: Dict[str, Tuple[str, str]] = {
    "make test": (".ci/run", "make test"),
    "hvdp run -np 2 --framework torch examples/train_digits.py":
        ("tests/parallel/test_examples.py", 'example("train_digits.py", framework'),  # plus --profile DIR
    "hvdp run -np 2 --framework torch examples/keras_digits.py":
        ("tests/parallel/test_examples.py", 'example("keras_digits.py", framework'),
    "hvdp run -np 2 --framework tensorflow examples/keras_digits.py":
        ("tests/parallel/test_examples.py", 'example("keras_digits.py", framework'),
    "hvdp run -np 4 --framework torch examples/ensemble.py":
        ("tests/parallel/test_mpi_groups.py", '("torch", "hvdp-run-gloo")'),
    "mpirun --allow-run-as-root --oversubscribe -np 4 .venv/bin/python examples/ensemble.py --framework tensorflow":
        ("tests/parallel/test_mpi_groups.py", '("tensorflow", "mpirun")'),
    "sbatch docker/slurm/hvdp.sbatch": ("tests/cluster/test_slurm.py", '"sbatch", "--parsable"'),
    "HVDP_FRAMEWORK=tensorflow sbatch docker/slurm/hvdp.sbatch": ("tests/cluster/test_slurm.py", '"HVDP_FRAMEWORK"'),
    "sbatch docker/slurm/hvdp.sbatch --mpi -- train.py --epochs 5":
        ("tests/cluster/test_slurm.py", 'f"--{controller}", "--", str(DIGITS_RANK)'),
    "squeue --me; scancel JOBID": ("tests/cluster/test_slurm.py", '"scancel"'),
    "hvdp bench --smoke": ("tests/parallel/test_bench_smoke.py", '"bench", "--smoke"'),
    "pip install -e '.[ray]'": ("scripts/setup.sh", "dev,ray]'"),
}

_NO_ENGINE = "no Docker engine here (tests/cluster/test_static.py lints the Dockerfiles and validates Compose)"
_NO_RAY_HOSTS = "no hosts 10.0.0.1, 10.0.0.2 here (tests/cluster/test_ray_two_nodes.py runs the same in namespaces)"
_NO_K8S = "no Kubernetes cluster or registry here (test_static.py validates the MPIJob's pod templates)"
#: not run by the test suite, and why
NOT_RUN: Dict[str, str] = {
    "make demo": "runs scripts/setup.sh (apt-get, pip, hvdp build) before two 20-epoch trainings; CI runs the "
                 "set-up itself and test_examples.py the trainings",
    "hvdp run -np 4 -H host1:2,host2:2 --framework torch train.py":
        "no hosts host1, host2 here (tests/cluster/test_multihost.py runs -H over ssh in network namespaces)",
    "hvdp run -np 4 -H node1:2,node2:2 --ssh-port 2222 --ssh-identity-file ~/.ssh/id_ed25519 "
    "--network-interface eth0 --framework torch examples/train_digits.py":
        "no hosts node1, node2 here (test_multihost.py runs the same options on its own hosts)",
    "hvdp run --hostfile hosts.txt --framework torch train.py": "no hosts here (hostfiles: tests/unit/test_launch.py)",
    "docker build -f docker/cpu/Dockerfile -t hvdp:cpu .": _NO_ENGINE,
    "docker build -f docker/gpu/Dockerfile -t hvdp:gpu .": _NO_ENGINE + "; no GPU",
    "docker compose -f docker/compose.yml up --build --abort-on-container-exit --exit-code-from launcher": _NO_ENGINE,
    "docker compose -f docker/compose.yml -f docker/compose.gpu.yml up --build --abort-on-container-exit "
    "--exit-code-from launcher": _NO_ENGINE + "; no GPU",
    "docker compose -f docker/compose.yml down -v": _NO_ENGINE,
    "kubectl apply --server-side -f https://raw.githubusercontent.com/kubeflow/mpi-operator/v0.6.0/deploy/v2beta1/"
    "mpi-operator.yaml": _NO_K8S,
    "docker build -f docker/cpu/Dockerfile -t REGISTRY/hvdp:cpu . && docker push REGISTRY/hvdp:cpu": _NO_K8S,
    "kubectl apply -f docker/k8s/mpijob.yaml": _NO_K8S,
    "kubectl get mpijob hvdp-digits -w": _NO_K8S,
    "kubectl logs -f job/hvdp-digits-launcher": _NO_K8S,
    "kubectl delete mpijob hvdp-digits": _NO_K8S,
    "sbatch --nodes=4 --ntasks-per-node=2 docker/slurm/hvdp.sbatch --mpi":
        "needs 4 nodes of 2 CPUs; the test cluster (tests/cluster/test_slurm.py) has 2 nodes of 1",
    "hvdp bench --quick": "3 rounds of every comparison take about 40 min; make test runs the smoke plan",
    "hvdp bench --json bench.json --plot bench.png": "the full benchmark takes hours (3 rounds of 100 steps)",
    "hvdp bench --only native,scaling --rounds 5": "5 rounds of two sections take over an hour",
    "python examples/ray_digits.py --framework torch":
        "starts a Ray cluster of its own; tests/parallel/test_ray.py runs the script on the module's cluster",
    "python examples/ray_digits.py --framework tensorflow --address HEAD:6379":
        "no cluster HEAD here; tests/cluster/test_ray_two_nodes.py runs --address on two network namespaces",
    "ray start --head --node-ip-address 10.0.0.1 --port 6379 --num-cpus 2": _NO_RAY_HOSTS,
    "ray start --address 10.0.0.1:6379 --node-ip-address 10.0.0.2 --num-cpus 2": _NO_RAY_HOSTS,
    "python examples/ray_digits.py --address 10.0.0.1:6379 --placement-strategy STRICT_SPREAD": _NO_RAY_HOSTS,
}

SHELL_LANGS = ("bash", "sh", "shell", "console")


def commands(fence: Fence) -> List[str]:
    """The commands of a block: shell lines (continuations joined, comments cut, spaces
    collapsed), or the `$ ` lines of a transcript."""
    if fence.lang in SHELL_LANGS:
        text = fence.code.replace("\\\n", " ")
        lines = [re.sub(r"\s+#\s.*$", "", line) for line in text.splitlines()]
    elif fence.lang == "":
        lines = [line[2:] for line in fence.code.splitlines() if line.startswith("$ ")]
    else:
        return []
    return [" ".join(line.split()) for line in lines if line.strip()]


def command_blocks() -> List[Tuple[Fence, List[str]]]:
    return [(f, commands(f)) for f in fences() if commands(f)]


def test_every_readme_command_is_run_or_says_why_not():
    blocks = command_blocks()
    found = [c for _, cs in blocks for c in cs]
    assert len(found) >= 30, f"only {len(found)} commands found in README.md and docs/*.md: is the parser right?"
    registered = {**HERE, **ELSEWHERE, **NOT_RUN}
    assert len(registered) == len(HERE) + len(ELSEWHERE) + len(NOT_RUN), "a command is registered twice"
    missing = sorted(set(found) - set(registered))
    assert not missing, f"commands of README.md or docs/*.md that no test runs and none says why: {missing}"
    gone = sorted(set(registered) - set(found))
    assert not gone, f"registered commands no longer in README.md or docs/*.md (update this file): {gone}"
    for name in set(HERE.values()):
        assert callable(globals().get(name)), f"{name} is not a test of this file"
    for path, needle in ELSEWHERE.values():
        assert needle in (REPO / path).read_text(), f"{path} no longer holds {needle!r}"
    for fence, cmds in blocks:
        not_run = [c for c in cmds if c in NOT_RUN]
        if not_run:
            assert fence.comment_above.startswith(NOT_RUN_MARK), \
                f"{fence.where}: {not_run} are not run; say why in '{NOT_RUN_MARK} ... -->' above the block"
        else:
            assert not fence.comment_above.startswith(NOT_RUN_MARK), \
                f"{fence.where}: every command of this block is run; drop its not-run comment"


# --- the commands run here ---------------------------------------------------------------------

def run(command: str, cwd: Path, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a documented command line as a user would, with the environment's bin/ first on PATH."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    for var in ("HVDP_FRAMEWORK", "KERAS_BACKEND", "OMP_NUM_THREADS"):
        env.pop(var, None)
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    proc.stdout += proc.stderr
    return proc


def readme_block(needle: str) -> str:
    """The code of the python block (README.md, docs/*.md) holding `needle` (exactly one)."""
    found = [f.code for f in python_fences() if needle in f.code]
    assert len(found) == 1, f"{len(found)} python blocks of the docs hold {needle!r}"
    return found[0]


def command(test: str) -> List[str]:
    return [c for c, name in HERE.items() if name == test]


def test_tensorflow_mpi_training_line():
    (line,) = command("test_tensorflow_mpi_training_line")
    proc = run(line, REPO)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert len(re.findall(r"epoch +\d+/30 +loss", proc.stdout)) == 30, proc.stdout[-3000:]
    found = re.findall(r"test accuracy: ([0-9.]+) \(\d+/360, tensorflow, 2 processes", proc.stdout)
    assert len(found) == 1 and float(found[0]) >= 0.95, proc.stdout[-3000:]


def test_dry_run_line(tmp_path):
    (line,) = command("test_dry_run_line")
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    proc = run(line, tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "HVDP_FRAMEWORK=torch" in proc.stdout.splitlines()
    assert re.search(r"horovodrun -np 2 --gloo \S*python[0-9.]* train\.py$", proc.stdout, re.M), proc.stdout
    assert not (tmp_path / "ran").exists(), "--dry-run started the script"


ELASTIC_PRELUDE = """\
import json
import torch
import hvdp

hvdp.init()
torch.manual_seed(hvdp.rank())  # different weights per rank: the elastic state brings rank 0's
model = torch.nn.Sequential(torch.nn.Linear(8, 4))
optimizer = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
epochs, batches = 2, 8


def step(i):
    g = torch.Generator().manual_seed(1000 * hvdp.rank() + i)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


"""
ELASTIC_REPORT = """
with open(f"report-{hvdp.rank()}.json", "w") as f:
    json.dump({"rank": hvdp.rank(), "size": hvdp.size(), "epoch": state.epoch, "batch": state.batch,
               "weights": [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]}, f)
"""


def test_elastic_line(tmp_path):
    """The elastic block (docs/elastic.md) is train.py; the discovery script lists two names of this
    machine (Horovod's elastic driver needs two hosts to pick a network interface)."""
    (line,) = command("test_elastic_line")
    script = tmp_path / "discover_hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    script.chmod(0o755)
    block = readme_block("state = hvdp.elastic.State(model, optimizer, epoch=0, batch=0)")
    (tmp_path / "train.py").write_text(ELASTIC_PRELUDE + block + ELASTIC_REPORT)
    proc = run(line, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["size"], r["epoch"], r["batch"]) for r in reports] == [(0, 2, 2, 0), (1, 2, 2, 0)]
    assert reports[0]["weights"] == reports[1]["weights"], "the replicas differ after elastic training"


MPI_REPORT = """
import json

record = {"world_rank": world.rank, "initialized": hvdp.is_initialized()}
if world.rank < 2:
    record.update(rank=hvdp.rank(), size=hvdp.size(), total=hvdp.allreduce(world.rank + 1, op="sum"))
with open(f"report-{world.rank}.json", "w") as f:
    json.dump(record, f)
"""


@pytest.mark.parametrize("line", command("test_mpi_program_lines"), ids=["mpirun", "hvdp-run-mpi"])
def test_mpi_program_lines(line, tmp_path):
    """my_mpi_program.py is the communicator block (docs/process-sets.md), then a report of what each process saw."""
    (tmp_path / ".venv").symlink_to(VENV_BIN.parent)  # the line names .venv/bin/python
    (tmp_path / "my_mpi_program.py").write_text(readme_block("comm=trainers") + MPI_REPORT)
    proc = run(line, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in range(4)]
    for r in reports[:2]:
        assert (r["initialized"], r["rank"], r["size"], r["total"]) == (True, r["world_rank"], 2, 3), r
    assert [r["initialized"] for r in reports[2:]] == [False, False]


def test_profile_transcript(tmp_path):
    """The two `$` lines of the profiler section, from a folder holding tests/ and docs/, with
    /tmp/prof moved into this test's folder; the report must find the skew it shows."""
    lines = [c.replace("/tmp/prof", str(tmp_path / "prof")) for c in command("test_profile_transcript")]
    (tmp_path / "tests").symlink_to(REPO / "tests")
    (tmp_path / "docs").mkdir()
    job = run(lines[0], tmp_path)
    assert job.returncode == 0, job.stdout[-4000:]
    report = run(lines[1], tmp_path, timeout=120)
    assert report.returncode == 0, report.stdout[-4000:]
    assert "Diagnosis: input skew: rank 1 is the straggler" in report.stdout, report.stdout
    assert re.search(r"^ +0 +\d+ ", report.stdout, re.M) and re.search(r"^ +1 +\d+ ", report.stdout, re.M)
    assert (tmp_path / "docs" / "profile_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

