"""hvdp run: the command and environment it builds, checked without starting processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hvdp.errors import LaunchError
from hvdp.launch import (
    build_command,
    expand_nodelist,
    expand_tasks_per_node,
    horovodrun_arity,
    parse_run_args,
    slurm_hosts,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "train_digits.py")


@pytest.fixture(scope="module")
def arity():
    return horovodrun_arity()


def test_horovodrun_arity_comes_from_horovodrun_itself(arity):
    assert arity["--network-interface"] == 1 and arity["--verbose"] == 0 and arity["-p"] == 1


def test_defaults_gloo_framework_env_and_thread_split(arity):
    args = parse_run_args(["-np", "2", "--framework", "torch", SCRIPT, "--epochs", "3"], arity)
    argv, env = build_command(args, {}, cpu_count=8, horovodrun="horovodrun")
    assert argv == ["horovodrun", "-np", "2", "--gloo", sys.executable, SCRIPT, "--epochs", "3"]
    assert env == {"HVDP_FRAMEWORK": "torch", "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "4",
                   "TF_NUM_INTRAOP_THREADS": "4", "TF_NUM_INTEROP_THREADS": "1",
                   "HOROVOD_STALL_CHECK_TIME_SECONDS": "60", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "300",
                   "HOROVOD_CYCLE_TIME": "5", "MALLOC_MMAP_THRESHOLD_": "134217728",
                   "MALLOC_TRIM_THRESHOLD_": "268435456", "THP_MEM_ALLOC_ENABLE": "1"}


def test_user_settings_win_over_defaults(arity):
    args = parse_run_args(["-np", "4", "--mpi", "python", "train.py"], arity)
    _, env = build_command(args, {"OMP_NUM_THREADS": "3", "PATH": "/usr/bin:/bin"}, cpu_count=2)
    assert "OMP_NUM_THREADS" not in env and env["TF_NUM_INTRAOP_THREADS"] == "1"
    assert "HVDP_FRAMEWORK" not in env


def test_measured_horovod_defaults_are_set_only_for_local_jobs_and_yield_to_the_user(arity):
    local = build_command(parse_run_args(["-np", "2", "--mpi", "python", "t.py"], arity), {"PATH": "/usr/bin:/bin"},
                          cpu_count=2)[1]
    assert local["HOROVOD_CYCLE_TIME"] == "5" and local["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert local["MALLOC_MMAP_THRESHOLD_"] == str(128 << 20) and local["MALLOC_TRIM_THRESHOLD_"] == str(256 << 20)
    assert local["THP_MEM_ALLOC_ENABLE"] == "1"
    gloo = build_command(parse_run_args(["-np", "2", "python", "t.py"], arity), {}, cpu_count=2)[1]
    assert "OMPI_MCA_mpi_yield_when_idle" not in gloo
    remote = build_command(parse_run_args(["-H", "a:1,b:1", "python", "t.py"], arity), {}, cpu_count=2)[1]
    assert "HOROVOD_CYCLE_TIME" not in remote and "MALLOC_MMAP_THRESHOLD_" not in remote
    assert "THP_MEM_ALLOC_ENABLE" not in remote
    mine = build_command(parse_run_args(["-np", "2", "python", "t.py"], arity), {"HOROVOD_CYCLE_TIME": "1"},
                         cpu_count=2)[1]
    assert "HOROVOD_CYCLE_TIME" not in mine


def test_unknown_flags_pass_through_with_their_values(arity):
    args = parse_run_args(["-np", "2", "--network-interface", "lo", "--verbose", "-H", "a:1,b:1",
                           "--start-timeout=30", "--fusion-threshold-mb", "8", "python", "-u", "t.py", "--lr", "1"],
                          arity)
    argv, env = build_command(args, {}, cpu_count=2)
    assert argv == ["horovodrun", "-np", "2", "--gloo", "-H", "a:1,b:1", "--network-interface", "lo",
                    "--verbose", "--start-timeout=30", "--fusion-threshold-mb", "8", "python", "-u", "t.py",
                    "--lr", "1"]
    assert "OMP_NUM_THREADS" not in env  # hosts given: hvdp does not guess their cores


def test_host_options_become_horovodrun_flags(arity, tmp_path):
    key = tmp_path / "id_ed25519"
    key.write_text("not read by hvdp\n")
    args = parse_run_args(["-H", "10.77.0.2:1,10.77.0.3", "--ssh-port", "2222", "--ssh-identity-file", str(key),
                           "--network-interface", "eth0", "--network-interfaces=eth1,eth0", "--mpi",
                           "python", "t.py"], arity)
    argv, env = build_command(args, {"PATH": "/usr/bin:/bin"}, cpu_count=2)
    # -np defaults to the slots of the hosts; a host without :N has one slot.
    assert argv == ["horovodrun", "-np", "2", "--mpi", "-H", "10.77.0.2:1,10.77.0.3:1", "--ssh-port", "2222",
                    "--ssh-identity-file", str(key), "--network-interface", "eth0", "--network-interface", "eth1",
                    "python", "t.py"]
    # horovodrun's own short forms are the same options.
    short = parse_run_args(["-np", "1", "-H", "h:1", "-p", "22", "-i", str(key), "python", "t.py"], arity)
    assert (short.ssh_port, short.ssh_identity_file, short.passthrough) == (22, str(key), [])


def test_hostfile_with_comments_and_every_slot_syntax(arity, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the MPI Operator writes 'host slots=N'\nworker-0.job slots=2\n\nworker-1.job:2  # ok\n"
                        "worker-2.job\nworker-3 slots=1 max_slots=4\n")
    argv, _ = build_command(parse_run_args(["-np", "5", "--hostfile", str(hostfile), "python", "t.py"], arity),
                            {}, cpu_count=2)
    assert argv[:6] == ["horovodrun", "-np", "5", "--gloo", "-H",
                        "worker-0.job:2,worker-1.job:2,worker-2.job:1,worker-3:1"]
    hostfile.write_text("worker-0 slots=two\n")
    with pytest.raises(LaunchError, match="line 1: 'worker-0 slots=two' is not 'host slots=N'"):
        build_command(parse_run_args(["--hostfile", str(hostfile), "python", "t.py"], arity), {}, 2)
    with pytest.raises(LaunchError, match="--hostfile 'nohosts' not found"):
        build_command(parse_run_args(["--hostfile", "nohosts", "python", "t.py"], arity), {}, 2)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("cn[098-101]", ["cn098", "cn099", "cn100", "cn101"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("a[1-2].cluster,b.cluster", ["a1.cluster", "a2.cluster", "b.cluster"]),
])
def test_slurm_nodelist_expands_like_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("spec, counts", [("1", [1]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2)", [4, 2, 2])])
def test_slurm_tasks_per_node_expands(spec, counts):
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("nodelist", ["node[01-", "node[3-1]", "node[a-b]", "node]1[", "a,,b", "x[1-2]]"])
def test_bad_slurm_nodelist_is_refused_with_the_value(nodelist):
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(nodelist)


@pytest.mark.parametrize("spec", ["2(3)", "x", "0", "2(x0)", ""])
def test_bad_slurm_tasks_per_node_is_refused(spec):
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node(spec)


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02],gpu5", "SLURM_TASKS_PER_NODE": "2(x2),1",
         "SLURM_CPUS_PER_TASK": "8"}


def test_inside_slurm_hosts_slots_np_and_threads_come_from_the_allocation(arity):
    argv, env = build_command(parse_run_args(["--framework", "torch", "python", "t.py"], arity), SLURM, 64)
    assert argv == ["horovodrun", "-np", "5", "--gloo", "-H", "node01:2,node02:2,gpu5:1", "python", "t.py"]
    assert env["OMP_NUM_THREADS"] == "8" and env["TF_NUM_INTRAOP_THREADS"] == "8"
    assert env["TF_NUM_INTEROP_THREADS"] == "1"
    # Fewer processes than tasks is allowed; explicit hosts win over the allocation.
    argv, env = build_command(parse_run_args(["-np", "2", "-H", "a:2", "python", "t.py"], arity), SLURM, 64)
    assert argv[:6] == ["horovodrun", "-np", "2", "--gloo", "-H", "a:2"] and "OMP_NUM_THREADS" not in env
    assert slurm_hosts({"SLURM_JOB_NODELIST": "n1"}) is None  # no job id: not in an allocation


def test_slurm_allocation_errors_name_the_variables(arity):
    args = parse_run_args(["python", "t.py"], arity)
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE is not set.*--ntasks-per-node"):
        build_command(args, {**SLURM, "SLURM_TASKS_PER_NODE": ""}, 2)
    with pytest.raises(LaunchError, match="has 3 nodes but SLURM_TASKS_PER_NODE '2' gives 1 counts"):
        build_command(args, {**SLURM, "SLURM_TASKS_PER_NODE": "2"}, 2)
    with pytest.raises(LaunchError, match="-np 9 but the hosts from the Slurm allocation have 5 slots"):
        build_command(parse_run_args(["-np", "9", "python", "t.py"], arity), SLURM, 2)


@pytest.mark.parametrize("argv, message", [
    (["-np", "two", "t.py"], "'two' is not a number"),
    (["-np", "0", "t.py"], "must be at least 1"),
    (["-np", "2"], "no command given"),
    (["-np", "2", "--framework", "pytorch", "t.py"], "Unknown framework 'pytorch'"),
    (["-np", "2", "--gloo", "--mpi", "t.py"], "choose one controller"),
    (["-np", "2", "--bogus", "t.py"], "unknown option '--bogus'"),
    (["-np", "2", "-H", "a:1", "--hostfile", "h", "t.py"], "not both"),
    (["-np", "2", "-H", "a:one,b:1", "t.py"], "'a:one' is not HOST or HOST:SLOTS"),
    (["-np", "2", "-H", "a:0", "t.py"], "a has 0 slots; give it at least 1"),
    (["-np", "2", "-H", "a:1,a:1", "t.py"], "names a twice"),
    (["-np", "2", "--ssh-port", "ssh", "t.py"], "'ssh' is not a port number"),
    (["-np", "2", "-p", "70000", "t.py"], "'70000' is not a port number"),
    (["-np", "2", "--network-interface", "eth 0", "t.py"], "'eth 0' is not a network interface name"),
    (["-np", "2", "--ssh-identity-file"], "needs a value"),
])
def test_bad_arguments_name_the_value_and_the_fix(arity, argv, message):
    with pytest.raises(LaunchError, match=message):
        parse_run_args(argv, arity)


def test_launcher_and_environment_contradictions_are_refused(arity):
    args = parse_run_args(["-np", "2", "--framework", "tensorflow", "python", "t.py"], arity)
    with pytest.raises(LaunchError, match="contradicts HVDP_FRAMEWORK=torch"):
        build_command(args, {"HVDP_FRAMEWORK": "torch"}, cpu_count=2)
    with pytest.raises(LaunchError, match="contradicts KERAS_BACKEND=jax"):
        build_command(args, {"KERAS_BACKEND": "jax"}, cpu_count=2)


def test_np_is_required_without_hosts_and_checked_against_slots(arity):
    with pytest.raises(LaunchError, match="-np is required"):
        build_command(parse_run_args(["--framework", "torch", "python", "t.py"], arity), {}, cpu_count=2)
    with pytest.raises(LaunchError, match=r"-np 3 but the hosts from -H have 2 slots \(a:1,b:1\); lower -np"):
        build_command(parse_run_args(["-np", "3", "-H", "a:1,b:1", "python", "t.py"], arity), {}, cpu_count=2)


def test_missing_identity_file_names_the_fix(arity):
    args = parse_run_args(["-np", "2", "-H", "a:1,b:1", "-i", "/nonexistent/key", "python", "t.py"], arity)
    with pytest.raises(LaunchError, match="--ssh-identity-file '/nonexistent/key' not found.*ssh-keygen"):
        build_command(args, {}, cpu_count=2)


def test_missing_script_and_missing_mpirun(arity):
    with pytest.raises(LaunchError, match="script 'nope.py' not found"):
        build_command(parse_run_args(["-np", "2", "nope.py"], arity), {}, cpu_count=2)
    with pytest.raises(LaunchError, match="mpirun not found.*openmpi-bin"):
        build_command(parse_run_args(["-np", "2", "--mpi", "python", "t.py"], arity), {"PATH": "/nonexistent"}, 2)


def test_dry_run_prints_command_and_environment():
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "run", "-np", "2", "--framework", "tensorflow",
                          "--dry-run", SCRIPT], capture_output=True, text=True, cwd=REPO, check=False,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "HVDP_FRAMEWORK=tensorflow" in lines and "KERAS_BACKEND=tensorflow" in lines
    assert lines[-1].endswith(f"-np 2 --gloo {sys.executable} {SCRIPT}")


def test_cli_reports_errors_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "hvdp.cli", "run", "-np", "2", "--framework", "mxnet", "t.py"],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 2
    assert out.stderr.startswith("hvdp: error: Unknown framework 'mxnet'") and "Traceback" not in out.stderr


def test_profile_timeline_and_stall_timeout_become_environment(arity, tmp_path):
    args = parse_run_args(["-np", "2", "--profile", str(tmp_path / "p"), "--timeline", "t.json",
                           "--stall-timeout", "100", "python", "t.py"], arity)
    _, env = build_command(args, {}, cpu_count=2)
    assert env["HVDP_PROFILE_DIR"] == str(tmp_path / "p")
    assert env["HOROVOD_TIMELINE"].endswith("/t.json") and env["HOROVOD_TIMELINE"].startswith("/")
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "100" and env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "20"
    _, default = build_command(parse_run_args(["-np", "2", "python", "t.py"], arity), {}, cpu_count=2)
    assert default["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "300"
    _, off = build_command(parse_run_args(["-np", "2", "--stall-timeout", "0", "python", "t.py"], arity), {}, 2)
    assert off["HOROVOD_STALL_CHECK_DISABLE"] == "1" and "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in off
    with pytest.raises(LaunchError, match="--stall-timeout 'soon' is not a whole number"):
        parse_run_args(["-np", "2", "--stall-timeout", "soon", "python", "t.py"], arity)


def test_job_watcher_names_the_cause_not_the_consequences():
    from hvdp.launch import JobWatcher

    watcher = JobWatcher()
    for line in ["[1]<stderr>:RuntimeError: injected failure at step 5\n",
                 "[0]<stderr>:RuntimeError: Horovod has been shut down. This was caused by ...\n",
                 "Process 0 exit with status code 1.\n", "Process 1 exit with status code 143.\n"]:
        watcher.feed(line)
    assert watcher.summary(1).startswith("hvdp: the job failed: rank 1 raised RuntimeError: injected failure")
    mpi = JobWatcher()
    mpi.feed("mpirun noticed that process rank 1 with PID 4242 on node host exited on signal 9 (Killed).\n")
    assert "rank 1 was killed by SIGKILL" in mpi.summary(137)
    stall = JobWatcher()
    stall.feed("[1,0]<stderr>:1!: [allreduce.weight, allreduce.bias]\n")
    assert "rank 1 never submitted allreduce.weight, allreduce.bias" in stall.summary(1)
    assert "Every rank must make the same collective calls" in stall.summary(1)  # one rank slow or stuck
    stall.silent(1, "worker2", 100.0, 16.0)  # its host was paused or cut off: the stall is a consequence
    assert stall.summary(1).startswith("hvdp: the job failed: rank 1 on worker2 went silent: nothing from it"), \
        stall.summary(1)
    stall.silent(0, "worker1", 101.0, 15.0)  # rank 0 silent too, but after rank 1: rank 1 is named
    assert "rank 1 on worker2 went silent" in stall.summary(1)
    lost = JobWatcher()
    lost.feed("[1,0]<stderr>:1!: [allreduce.weight]\n")
    lost.lost(0, "worker1", 100.0)  # a rank lost, but not the one that stalled: the stall is reported
    assert "rank 1 never submitted allreduce.weight" in lost.summary(1)
    keras = JobWatcher()  # rank 1 built a model with one more layer: each waits for the other's list
    keras.feed("[0]<stdout>:Missing ranks:\n[0]<stdout>:0!: [hvdp.gradients.0.g0_1of6, hvdp.gradients.0.g0_2of6]\n"
               "[0]<stdout>:1: [hvdp.gradients.0.g0_1of4, hvdp.gradients.0.g0_2of4]\n")  # TensorFlow's names
    assert "models differ: rank 0 reduces 4 gradients; rank 1 reduces 6 gradients. A layer" in keras.summary(1)
    assert "hvdp.check_consistency(model)" in keras.summary(1)
    on_torch = JobWatcher()  # Keras on torch: Horovod's torch names its groups
    on_torch.feed("[0]<stdout>:0: [grouped_allreduce.hvdp.gradients_1of4, grouped_allreduce.hvdp.gradients_2of4]\n")
    on_torch.feed("[0]<stdout>:1!: [grouped_allreduce.hvdp.gradients_1of2]\n")
    assert "models differ: rank 0 reduces 2 gradients; rank 1 reduces 4 gradients." in on_torch.summary(1)
    torch = JobWatcher()
    for line in ["[1,0]<stderr>:0: [allreduce.head.weight]\n", "[1,0]<stderr>:1!: [allreduce.fc.weight]\n"]:
        torch.feed(line)
    assert "models differ: rank 0 has no head.weight; rank 1 has no fc.weight. A layer" in torch.summary(1)


def test_exit_codes_are_described_as_signals_only_when_they_are():
    from hvdp.launch import describe_exit

    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(137) == "was killed by SIGKILL"
    assert describe_exit(255) == "exited with status 255" and describe_exit(1) == "exited with status 1"
