"""A failing rank ends the whole job quickly, and hvdp run names it (np=2).

The six jobs that wait out a 10 s stall timeout (a stalled rank, a paused one; Gloo and MPI; a stalled rank on
TensorFlow's direct path; models that differ between the ranks, on Horovod's path) and the job whose models differ
on the direct path (refused at its first step) run side by side (harness.side_by_side): what they time starts at
the fault, once the job is up."""

from __future__ import annotations

import functools
import socket
import time

import pytest
from harness import WORKERS, run_job, side_by_side

from hvdp.launch.watch import JobWatcher
from hvdp.launch.worker import HEARTBEAT_S


def run_fault(mode, controller, tmp_path, *extra, framework="torch"):
    worker = "faults.py" if framework == "torch" else "faults_tf.py"
    job = run_job([f"--{controller}", "--framework", framework, *extra, str(WORKERS / worker), mode], tmp_path,
                  timeout=240)
    ended = time.time()
    detection = ended - float((tmp_path / "fault_time").read_text())
    return job, detection


_KILLED: dict = {}


def killed_job(controller, tmp_path_factory):
    """One kill -9 job per controller (with --log-dir), shared by the two tests that read it."""
    if controller not in _KILLED:
        out = tmp_path_factory.mktemp(f"kill9-{controller}")
        _KILLED[controller] = (*run_fault("kill9", controller, out, "--log-dir", str(out / "logs")), out)
    return _KILLED[controller]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_kill_9_of_one_rank_ends_the_job_within_60_s_naming_it(controller, tmp_path_factory):
    job, detection, _ = killed_job(controller, tmp_path_factory)
    assert job.returncode != 0
    assert detection < 60, detection
    assert "hvdp: the job failed: rank 1 was killed by SIGKILL" in job.output, job.output[-3000:]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_an_exception_on_one_rank_is_named_as_the_cause(controller, tmp_path):
    job, detection = run_fault("raise", controller, tmp_path)
    assert job.returncode != 0 and detection < 60
    assert "rank 1 raised RuntimeError: injected failure at step 5" in job.output, job.output[-3000:]
    assert "rank 0 raised" not in job.output  # rank 0 only stopped because rank 1 failed


@pytest.fixture(scope="module")
def waiting_jobs(tmp_path_factory):
    """The stall and pause jobs under both controllers, a stall on TensorFlow's direct path and the job whose
    ranks' models differ on each gradient path, at once: (mode, controller) -> (job, detection),
    ("differ", "horovod-path") -> job and ("differ", "direct-path") -> (job, seconds)."""
    jobs = {(mode, controller): functools.partial(
        run_fault, mode, controller, tmp_path_factory.mktemp(f"{mode}-{controller}"), "--stall-timeout", "10")
        for mode in ("stall", "pause") for controller in ("gloo", "mpi")}
    jobs[("late", "mpi")] = functools.partial(run_fault, "late", "mpi", tmp_path_factory.mktemp("late-mpi"),
                                              "--stall-timeout", "10")
    jobs[("stall", "gloo-tensorflow")] = functools.partial(
        run_fault, "stall", "gloo", tmp_path_factory.mktemp("stall-tensorflow"), "--stall-timeout", "10",
        framework="tensorflow")
    differ = ["--gloo", "--framework", "tensorflow", str(WORKERS / "different_models.py")]
    jobs[("differ", "horovod-path")] = functools.partial(
        run_job, ["--stall-timeout", "10", *differ], tmp_path_factory.mktemp("differ-horovod"), timeout=240,
        extra_env={"HVDP_GRADIENT_PATH": "horovod"})

    def differ_direct():
        started = time.time()
        job = run_job(["--stall-timeout", "120", *differ], tmp_path_factory.mktemp("differ-direct"), timeout=240)
        return job, time.time() - started

    jobs[("differ", "direct-path")] = differ_direct
    return side_by_side(jobs)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_stalled_rank_ends_the_job_after_the_stall_timeout_naming_rank_and_tensors(controller, waiting_jobs):
    """Over 60 s for the first: the fixture runs the six stall-timeout jobs side by side."""
    job, detection = waiting_jobs[("stall", controller)].result()
    assert job.returncode != 0
    assert 10 <= detection < 10 + 20, detection  # Horovod checks every timeout/5 s, then the launcher stops
    assert "hvdp: the job was ended: rank 1 never submitted allreduce." in job.output, job.output[-3000:]


def test_a_rank_that_never_reaches_init_ends_the_job_after_the_stall_timeout_naming_the_waiting_rank(waiting_jobs):
    """Under MPI, Horovod's init waits in MPI_Init for every rank, with no timeout of its own (an MPI that hangs
    there, too, waited for ever): rank 0 ends itself after the stall timeout and 60 s for the ranks' start,
    saying why, and the job ends."""
    job, detection = waiting_jobs[("late", "mpi")].result()
    assert job.returncode != 0
    # the stall timeout and 60 s for the ranks' start, from rank 0's init (rank 1 writes its time after its
    # imports, some seconds before or after rank 0's init began)
    assert 70 - 20 <= detection < 70 + 30, detection
    assert "rank 0 raised StallError: Horovod's initialization (hvdp.init) did not finish in 70 s (the stall " \
           "timeout, 10 s (hvdp run --stall-timeout), and 60 s for the ranks' start)" in job.output, job.output[-3000:]
    assert "A rank that has not reached hvdp.init() (see its output)" in job.output, job.output[-3000:]


def test_a_stalled_rank_on_tensorflows_direct_path_ends_the_job_naming_it(waiting_jobs):
    """Rank 0's direct exchange of the gradients' layout waits out the stall timeout, then prints the stall
    report's lines: the job ends naming rank 1, as on Horovod's path."""
    job, detection = waiting_jobs[("stall", "gloo-tensorflow")].result()
    assert job.returncode != 0
    assert 10 <= detection < 10 + 20, detection
    assert "hvdp: the job was ended: rank 1 never submitted allreduce.hvdp.direct.tf_" in job.output, \
        job.output[-3000:]


def test_models_that_differ_between_ranks_are_refused_at_the_first_step_on_the_direct_path(waiting_jobs):
    """Rank 1's Keras model has a layer more: on TensorFlow's direct path the layout exchange before the first
    gradients' allreduce sees it, and every rank raises TensorMismatchError naming each rank's gradients, without
    waiting for the 120 s stall timeout (was: Horovod's path, then the stall timeout)."""
    job, seconds = waiting_jobs[("differ", "direct-path")].result()
    assert job.returncode != 0
    assert "The ranks reduce different gradients, so their models differ: rank 0 reduces 2 gradients " \
           "(36 elements); rank 1 reduces 4 gradients (56 elements)." in job.output, job.output[-3000:]
    assert "TensorMismatchError" in job.output and "hvdp.check_consistency(model)" in job.output
    assert "stalled" not in job.output and seconds < 100, (seconds, job.output[-3000:])


def test_models_that_differ_between_ranks_end_the_stall_saying_so(waiting_jobs):
    """Rank 1's Keras model has a layer more: on Horovod's path, the stall's message says the models differ,
    with each rank's number of gradients (was: only the tensor names each rank never submitted)."""
    job = waiting_jobs[("differ", "horovod-path")].result()
    assert job.returncode != 0
    assert "The ranks reduce different gradients, so their models differ: rank 0 reduces 2 gradients; " \
           "rank 1 reduces 4 gradients." in job.output, job.output[-3000:]
    assert "hvdp.check_consistency(model)" in job.output


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_rank_killed_with_its_bootstrap_is_named_as_lost_with_its_host(controller, tmp_path):
    """No exit status and no record can come (as when a worker's container is killed): the rank's
    connection to hvdp run closed without one, and that names it."""
    job, detection = run_fault("vanish", controller, tmp_path)
    assert job.returncode != 0 and detection < 60, detection
    host = socket.gethostname()
    assert f"hvdp: the job failed: rank 1 on {host} was lost: its processes ended without an exit status" \
        in job.output, job.output[-3000:]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_paused_rank_ends_the_job_after_the_stall_timeout_naming_it(controller, waiting_jobs):
    """A rank and its bootstrap stopped (SIGSTOP, as a paused container): alive, but its heartbeat stops.
    Unwatched, the job waited for Gloo's or MPI's own timeouts and blamed rank 0."""
    job, detection = waiting_jobs[("pause", controller)].result()
    assert job.returncode != 0
    # Silence counts from the last heartbeat (up to HEARTBEAT_S before the pause); then the job is stopped.
    assert 10 - HEARTBEAT_S <= detection < 10 + 15, detection
    assert f"hvdp: the job failed: rank 1 on {socket.gethostname()} went silent: nothing from it, not even its " \
           "heartbeat, for 1" in job.output, job.output[-3000:]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovods_own_text_names_a_killed_rank_where_no_record_exists(controller, tmp_path_factory):
    """What horovodrun and mpirun print when a rank dies of a signal (kept in --log-dir's launcher.log)
    is all the watcher needs when no record comes: each pattern against the text Horovod really prints."""
    job, _, tmp_path = killed_job(controller, tmp_path_factory)
    assert job.returncode != 0
    assert "Killed" not in job.output, job.output[-3000:]  # horovodrun's account: the record says it
    watcher = JobWatcher()
    for line in (tmp_path / "logs" / "launcher.log").read_text().splitlines(keepends=True):
        watcher.feed(line)
    assert watcher.records == [] and "rank 1 was killed by SIGKILL" in watcher.summary(1), watcher.failed


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_script_without_hvdp_init_is_named_from_its_traceback(controller, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import os\nif os.environ.get('HOROVOD_RANK', os.environ.get('OMPI_COMM_WORLD_RANK')) == '1':\n"
                      "    raise RuntimeError('plain failure')\n")
    job = run_job([f"--{controller}", str(script)], tmp_path, timeout=120)
    assert job.returncode != 0
    assert "hvdp: the job failed: rank 1 raised RuntimeError: plain failure" in job.output, job.output[-3000:]
    assert "[1] RuntimeError: plain failure" in job.output.splitlines()  # printed by the rank, prefixed
