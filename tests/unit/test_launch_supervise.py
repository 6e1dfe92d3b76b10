"""hvdp run's supervisor without Horovod: Open MPI's cut lines put back together, and a real
process tree (with an orphan and a process that ignores SIGTERM) ended by a signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hvdp.launch.elastic import ElasticReporter
from hvdp.launch.watch import JobWatcher, TagJoiner


def test_tag_joiner_rebuilds_lines_cut_into_tagged_pieces():
    joiner = TagJoiner()
    # As Open MPI printed an unbuffered traceback's marker line, with rank 0 speaking in between.
    assert joiner.feed("[1,1]<stderr>:     [1,1]<stderr>:~[1,1]<stderr>:~[1,0]<stdout>:step 3\n") == \
        ["[1,0]<stdout>:step 3\n"]
    assert joiner.feed("[1,1]<stderr>:^[1,1]<stderr>:^\n") == ["[1,1]<stderr>:     ~~^^\n"]
    assert joiner.feed("mpirun noticed that process rank 1 exited\n") == ["mpirun noticed that process rank 1 exited\n"]
    assert joiner.feed("[1,0]<stderr>:unfinished") == []
    assert joiner.flush() == ["[1,0]<stderr>:unfinished\n"]


TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out = sys.argv[1]
    # a child that ignores SIGTERM, and an orphan (its parent exits at once)
    stubborn = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    middle = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        "open(sys.argv[1], 'w').write(str(p.pid))", out + "/orphan"])
    middle.wait()
    open(out + "/pids", "w").write(f"{stubborn.pid} {open(out + '/orphan').read()}")
    time.sleep(600)
""")

SUPERVISOR = textwrap.dedent("""
    import sys
    from hvdp.launch import supervise
    job = supervise.SupervisedJob(command=[sys.executable, sys.argv[1], sys.argv[2]],
                                  env=dict(__import__("os").environ), grace_s=2.0)
    code, _ = supervise.supervise(job)
    sys.exit(code)
""")


def start_supervisor(tmp_path, job: str, supervisor: str, until: str, poll_s: float) -> subprocess.Popen:
    """``supervisor`` (a script) supervising ``job`` (a script) in ``tmp_path``, started once the job has
    written ``tmp_path / until`` (or after 60 s)."""
    (tmp_path / "job.py").write_text(job)
    (tmp_path / "supervisor.py").write_text(supervisor)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "supervisor.py"), str(tmp_path / "job.py"),
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 60
    while not (tmp_path / until).exists() and time.monotonic() < deadline:
        time.sleep(poll_s)
    return proc


def test_a_signal_ends_the_whole_tree_orphans_and_sigterm_ignorers_included(tmp_path):
    proc = start_supervisor(tmp_path, TREE, SUPERVISOR, until="pids", poll_s=0.1)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    orphan = pids[1]
    assert int(Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1]) == proc.pid  # adopted
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - started
    assert proc.returncode == 128 + signal.SIGTERM, err
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or \
            Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", pid
    last = err.strip().splitlines()[-1]
    assert last.startswith("hvdp run: stopped by SIGTERM: ended 3 helper processes in ")
    assert last.endswith("; SIGKILL for a helper process."), last
    assert 2 <= took < 6, took


def test_the_tree_read_while_processes_come_and_go_still_holds_every_live_one():
    """A job's helpers vanish while hvdp run reads its tree; the ones still alive must stay in it
    (an empty read made stop_tree skip the grace period and SIGKILL ranks at once)."""
    from hvdp.launch.stop import descendants

    steady = subprocess.Popen(["sleep", "60"])
    churn = subprocess.Popen(["bash", "-c", "while true; do /bin/true & /bin/true & wait; done"])
    try:
        time.sleep(0.3)
        reads = 500
        missed = sum(steady.pid not in {p.pid for p in descendants()} for _ in range(reads))
    finally:
        churn.kill()
        steady.kill()
        churn.wait()
        steady.wait()
    assert missed == 0, f"a live child was missing from {missed} of {reads} reads of the tree"


def test_the_wait_message_names_workers_hosts_causes_listing_and_time():
    watcher = JobWatcher()
    watcher.feed("[1]<stderr>:RuntimeError: boom at step 30\n")
    said = []
    reporter = ElasticReporter(2, watcher, lambda: "localhost:2, 127.0.0.1:1", said.append)
    reporter.handle({"event": "exit", "host": "localhost", "slot": 1, "rank": 1, "code": 1})
    reporter.handle({"event": "recorded", "failed": [["localhost", 1]],
                     "ready": [["localhost", 0], ["127.0.0.1", 0]], "success": 0, "size": 3})
    reporter.handle({"event": "blacklisted", "host": "localhost", "ranks": [1], "until": None})
    reporter.handle({"event": "waiting", "phase": "resume", "min_np": 2, "min_hosts": 1, "slots": 1,
                     "timeout": 120})
    (message,) = said
    assert message.splitlines() == [
        "hvdp run: the job is below --min-np 2: 1 worker left, 1 usable slot(s) now.",
        "hvdp run:   removed localhost (rank 1 raised RuntimeError: boom at step 30; 1 healthy worker on it "
        "stopped too: Horovod removes whole hosts), blacklisted for good (no --blacklist-cooldown-range)",
        "hvdp run:   the discovery script lists now: localhost:2, 127.0.0.1:1",
        "hvdp run:   waiting up to 120 s more (--elastic-timeout 120) for 2 usable slots; Ctrl-C ends the job.",
    ]
    reporter.handle({"event": "timeout", "message": "Timed out"})
    assert reporter.final_line() == (
        "hvdp: the elastic job was ended: it waited 120 s (--elastic-timeout) with 1 worker for 2 usable slots "
        "(--min-np) and the hosts offered 1. List more hosts in the discovery script, lower --min-np, or raise "
        "--elastic-timeout.")


def test_the_remote_stop_script_ends_exactly_the_jobs_processes(tmp_path):
    """What hvdp run runs over ssh on every remote host, run here on processes of two jobs."""
    from hvdp.launch.stop import JOB_ID_VAR, stop_script

    def start(job_id, ignore_term=False):
        ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else "pass"
        code = f"import signal, time\n{ignore}\ntime.sleep(600)"
        return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, JOB_ID_VAR: job_id})

    ours = [start("job-a"), start("job-a", ignore_term=True)]
    other = start("job-ab")  # another job whose id starts the same way
    try:
        time.sleep(0.5)
        done = subprocess.run(["sh", "-c", stop_script("job-a")], timeout=30, check=False)
        assert done.returncode == 0
        for proc in ours:
            assert proc.wait(timeout=5) in (-signal.SIGTERM, -signal.SIGKILL)
        assert ours[1].returncode == -signal.SIGKILL and other.poll() is None
    finally:
        for proc in [*ours, other]:
            proc.kill()
            proc.wait()


LOST_JOB = textwrap.dedent("""
    import json, os, socket, subprocess, sys, time
    host, port, token = os.environ["HVDP_OUTPUT_ADDRESS"].rsplit(":", 2)
    hello = lambda rank, name: (json.dumps({"token": token, "rank": rank, "host": name}) + "\\n").encode()
    # rank 0's connection stays open in a process the job leaves behind (as a remote rank may)
    subprocess.Popen([sys.executable, "-c", "import socket, sys, time; "
                      f"c = socket.create_connection(({host!r}, {port})); c.sendall({hello(0, 'worker1')!r}); "
                      "open(sys.argv[1], 'w').close(); time.sleep(60)", sys.argv[1] + "/rank0"])
    while not os.path.exists(sys.argv[1] + "/rank0"):
        time.sleep(0.05)
    lost = socket.create_connection((host, int(port)))  # rank 1: its connection closes with no exit status
    lost.sendall(hello(1, "worker2"))
    time.sleep(0.3)
    lost.close()
    time.sleep(0.3)
    open(sys.argv[1] + "/exited", "w").close()
    sys.exit(1)
""")

LOST_SUPERVISOR = textwrap.dedent("""
    import os, sys
    from hvdp.launch import supervise
    from hvdp.launch.stop import descendants
    def say(code, watcher):  # as hvdp run says it: the summary, and how much of the job was still there
        job.terminal.line("stderr", f"{len(descendants())} left; {watcher.summary(code)}\\n".encode(), final=True)
    job = supervise.SupervisedJob(command=[sys.executable, sys.argv[1], sys.argv[2]], env=dict(os.environ),
                                  output=supervise.Output(), on_end=say)
    code, _ = supervise.supervise(job)
    sys.exit(code)
""")


def test_a_failure_is_said_at_once_when_a_signal_comes_after_the_job_and_before_its_leftovers_are_stopped(
        tmp_path):
    """Compose stops the launcher's container (SIGTERM) as soon as a worker's ends: the job has failed, hvdp
    run is still waiting for the last output of a rank it left behind, and says why the job failed at once."""
    proc = start_supervisor(tmp_path, LOST_JOB, LOST_SUPERVISOR, until="exited", poll_s=0.05)
    time.sleep(0.5)  # hvdp run waits (up to 5 s) for rank 0's last output
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("1 left; hvdp: the job failed: rank 1 on worker2 was lost: its processes ended "), err
    assert time.monotonic() - signalled < 4, err  # not after the 5 s wait
