"""An elastic job left with fewer workers than --min-np, under `hvdp run --elastic`, for real.

The discovery script lists names of this machine (localhost, 127.0.0.1), so Horovod treats
them as separate hosts and blacklists only the failed worker's. What the user must see at
once on the launcher's terminal: how many workers are left, which host was removed and why
(the failed rank and its error), what the discovery script lists now, and how long the job
will wait; then the same every 10 s; then, when --elastic-timeout runs out, one line naming
the cause and a non-zero exit, or on Ctrl-C the whole job ended.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
from harness import WORKERS
from live_job import LiveJob, job_processes

#: Measured: the message comes 1.5-2 s after the failure (the other workers must notice it first).
MESSAGE_WITHIN_S = 15


def discovery(tmp_path, hosts):
    (tmp_path / "hosts").write_text("".join(f"{h}\n" for h in hosts))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    return str(script)


def failure(tmp_path):
    when, rank = (tmp_path / "failed").read_text().split()
    return float(when), int(rank)


def test_one_of_two_hosts_fails_the_job_says_why_it_waits_then_ends_at_the_elastic_timeout(tmp_path):
    """torch; 2 one-slot hosts, --min-np 2: the failed host is blacklisted for good, 1 worker is left."""
    script = discovery(tmp_path, ["localhost:1", "127.0.0.1:1"])
    job = LiveJob(["--elastic", "-np", "2", "--min-np", "2", "--elastic-timeout", "15", "--host-discovery-script",
                   script, "--framework", "torch", str(WORKERS / "elastic_wait.py"), "torch", "127.0.0.1", "0"],
                  tmp_path)
    shown, first = job.wait_for(r"^hvdp run: the job is below --min-np 2", timeout=180)
    failed_at, rank = failure(tmp_path)
    assert first == "hvdp run: the job is below --min-np 2: 1 worker left, 1 usable slot(s) now."
    assert 0 < shown - failed_at < MESSAGE_WITHIN_S
    block = [line for when, line in job.lines if when >= shown][:4]
    assert block[1] == (f"hvdp run:   removed 127.0.0.1 (rank {rank} raised RuntimeError: injected failure on "
                        f"127.0.0.1), blacklisted for good (no --blacklist-cooldown-range)"), block
    assert block[2] == "hvdp run:   the discovery script lists now: localhost:1, 127.0.0.1:1", block
    assert block[3].startswith("hvdp run:   waiting up to 1") and \
        block[3].endswith(" s more (--elastic-timeout 15) for 2 usable slots; Ctrl-C ends the job."), block
    again, _ = job.wait_for(r"^hvdp run: the job is below --min-np 2", timeout=20, after=shown + 1)
    assert 9 <= again - shown <= 16, again - shown  # every 10 s (measured 10.1-10.2 s)
    code = job.wait(timeout=60)
    ended = time.time()
    last = job.output.strip().splitlines()[-1]
    assert code != 0
    assert last == ("hvdp: the elastic job was ended: it waited 15 s (--elastic-timeout) with 1 worker for 2 usable "
                    "slots (--min-np) and the hosts offered 1. List more hosts in the discovery script, lower "
                    "--min-np, or raise --elastic-timeout."), job.output[-3000:]
    assert 15 <= ended - shown <= 15 + 10, ended - shown
    assert not job_processes(tmp_path)
    # The failed worker's record: its traceback, once, when it arrived (the job went on).
    lines = job.output.splitlines()
    assert lines.count(f"[{rank}] Traceback (most recent call last):") == 1, job.output[-3000:]
    assert f"[{rank}] RuntimeError: injected failure on 127.0.0.1" in lines, job.output[-3000:]
    print(f"\nfailure -> message {shown - failed_at:.2f} s; message -> end {ended - shown:.2f} s; exit {code}")


def test_one_worker_of_a_two_slot_host_fails_its_healthy_one_goes_too_and_ctrl_c_ends_the_wait(tmp_path):
    """Keras on TensorFlow; hosts localhost:2 and 127.0.0.1:1, -np 3, --min-np 2: the failure on
    localhost removes both of its workers (Horovod blacklists hosts), 1 worker is left."""
    script = discovery(tmp_path, ["localhost:2", "127.0.0.1:1"])
    job = LiveJob(["--elastic", "-np", "3", "--min-np", "2", "--host-discovery-script", script,
                   "--blacklist-cooldown-range", "100", "200", "--framework", "tensorflow",
                   str(WORKERS / "elastic_wait.py"), "keras", "localhost", "1"], tmp_path)
    shown, first = job.wait_for(r"^hvdp run: the job is below --min-np 2", timeout=240)
    failed_at, rank = failure(tmp_path)
    assert first == "hvdp run: the job is below --min-np 2: 1 worker left, 1 usable slot(s) now."
    assert 0 < shown - failed_at < MESSAGE_WITHIN_S
    block = [line for when, line in job.lines if when >= shown][:4]
    assert block[1].startswith(f"hvdp run:   removed localhost (rank {rank} raised RuntimeError: injected failure "
                               f"on localhost; 1 healthy worker on it stopped too: Horovod removes whole hosts), "
                               f"blacklisted until "), block
    assert block[2] == "hvdp run:   the discovery script lists now: localhost:2, 127.0.0.1:1", block
    assert "(--elastic-timeout 120)" in block[3], block  # hvdp's default
    assert len(job_processes(tmp_path)) >= 2  # the driver and the worker left are waiting
    sent = time.time()
    job.proc.send_signal(signal.SIGINT)
    code = job.wait(timeout=30)
    took = time.time() - sent
    time.sleep(0.3)
    assert code == 128 + signal.SIGINT, job.output[-3000:]
    assert job.output.strip().splitlines()[-1].startswith("hvdp run: stopped by SIGINT: ended horovodrun, rank")
    assert took < 10, took
    assert not job_processes(tmp_path)
    print(f"\nfailure -> message {shown - failed_at:.2f} s; Ctrl-C -> end {took:.2f} s; exit {code}")


@pytest.fixture(autouse=True)
def _nothing_left(tmp_path):
    yield
    assert not job_processes(tmp_path)


def test_a_blacklisted_host_comes_back_after_its_cooldown_and_the_job_finishes(tmp_path):
    """torch; the same two-slot host failure with --blacklist-cooldown-range 5 10: Horovod's first
    cooldown is min(10, 2 * 5 + up to 5) = 10 s; then localhost's 2 slots are used again."""
    script = discovery(tmp_path, ["localhost:2", "127.0.0.1:1"])
    job = LiveJob(["--elastic", "-np", "3", "--min-np", "2", "--host-discovery-script", script,
                   "--blacklist-cooldown-range", "5", "10", "--framework", "torch",
                   str(WORKERS / "elastic_wait.py"), "torch", "localhost", "1", "60"], tmp_path)
    shown, _ = job.wait_for(r"^hvdp run: the job is below --min-np 2", timeout=180)
    failed_at, _ = failure(tmp_path)
    until = job.wait_for(r"^hvdp run:   removed localhost .* blacklisted until ", timeout=5)[1]
    back, line = job.wait_for(r"^hvdp run: enough slots again", timeout=60)
    assert line == "hvdp run: enough slots again (3 for --min-np 2); the job goes on.", line
    code = job.wait(timeout=120)
    assert code == 0, job.output[-4000:]
    ranks = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1, 2] and all((r["step"], r["size"]) == (60, 3) for r in ranks), ranks
    # One worker was there from the start (it waited, at 1 < --min-np, without training); two joined.
    started = sorted(r["sizes"][0][1] for r in ranks)
    assert started[0] < failed_at < back < started[1] <= started[2], (started, failed_at, back)
    assert all([size for size, _ in r["sizes"]] == [3] for r in ranks), ranks
    # The host is blacklisted 1.5-7 s after the failure (once the others have noticed it), then
    # 10 s of cooldown and up to 1 s for the discovery script to be run again.
    assert 10 <= back - failed_at <= 10 + 20, back - failed_at
    print(f"\nfailure -> message {shown - failed_at:.2f} s ({until.split('blacklisted ')[1]}); "
          f"failure -> 3 workers again {back - failed_at:.2f} s; exit {code}")


def test_one_host_listed_without_network_interface_the_job_says_it_waits_for_a_second_host(tmp_path):
    """Horovod's elastic driver needs 2 hosts to find their common interfaces unless
    --network-interface is given: enough slots, yet it waits; no worker starts."""
    script = discovery(tmp_path, ["localhost:2"])
    job = LiveJob(["--elastic", "-np", "2", "--min-np", "2", "--elastic-timeout", "10", "--host-discovery-script",
                   script, "--framework", "torch", str(WORKERS / "elastic_wait.py"), "torch", "localhost", "9"],
                  tmp_path)
    _, note = job.wait_for(r"^hvdp run: the discovery script lists 1 host", timeout=60)
    assert note == ("hvdp run: the discovery script lists 1 host(s) now; Horovod's elastic driver waits for 2 to "
                    "find their common network interfaces (up to --elastic-timeout 10 s) unless "
                    "--network-interface NIC is given (e.g. lo when every host is this machine).")
    shown, first = job.wait_for(r"^hvdp run: waiting for a second host", timeout=120)
    assert first == ("hvdp run: waiting for a second host to start the job: Horovod's elastic driver needs 2 hosts "
                     "listed to find their common network interfaces, unless --network-interface is given.")
    block = [line for when, line in job.lines if when >= shown][:3]
    assert block[1] == "hvdp run:   the discovery script lists now: localhost:2", block
    assert block[2].endswith("(--elastic-timeout 10) for 2 hosts (or restart with --network-interface NIC, e.g. lo "
                             "when every host is this machine); Ctrl-C ends the job."), block
    code = job.wait(timeout=60)
    assert code != 0
    assert job.output.strip().splitlines()[-1] == (
        "hvdp: the elastic job was ended: it waited 10 s (--elastic-timeout) for a second host: Horovod's elastic "
        "driver needs 2 hosts listed to find their common network interfaces, and the discovery script listed 1. "
        "List another host, or give --network-interface NIC (e.g. lo when every host is this machine).")
    assert not list(tmp_path.glob("rank*.json"))  # no worker started
