"""What each rank writes, for hvdp run's output modes: rank 0 a line, a redrawn progress line and
a line on stderr; rank 1 one line on stdout and one on stderr while rank 0's progress line is
unfinished; both TensorFlow's start-up lines first (as TensorFlow writes them, to stderr, before
hvdp.init); then both, at the same moments, lines written in pieces (PYTHONUNBUFFERED print, one
write per argument, and lines in two writes with a pause between, rank 0's pause the longer)."""

from __future__ import annotations

import sys
import time

NOISE = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
         "I0000 00:00:1796116390.501697   27002 port.cc:153] oneDNN custom operations are on. You may see slightly "
         "different numerical results due to floating-point round-off errors from different computation orders. "
         "To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n")
#: Lines of each kind each rank writes in pieces.
PIECES = 20


def main() -> None:
    sys.stderr.write(NOISE)
    sys.stderr.flush()
    import hvdp

    hvdp.init()
    rank = hvdp.rank()
    hvdp.barrier()
    if rank == 0:
        print(f"hello from rank 0 (stdout a terminal: {sys.stdout.isatty()})", flush=True)
        for step in range(3):
            sys.stderr.write(f"\rprogress {step + 1}/3")
            sys.stderr.flush()
            time.sleep(0.05)
        sys.stderr.write("\n")
    else:
        time.sleep(0.02)
        print(f"hello from rank {rank}", flush=True)
        print(f"warning from rank {rank}", file=sys.stderr, flush=True)
    for i in range(PIECES):
        hvdp.barrier()
        print("PART", f"rank={rank}", f"i={i}", "a", "b", "c", "END", flush=True)
        sys.stdout.write(f"TWO rank={rank} i={i}")
        sys.stdout.flush()
        time.sleep(0.03 if rank == 0 else 0.01)  # rank 1's line ends while rank 0's does not yet
        sys.stdout.write(" END\n")
        sys.stdout.flush()
    hvdp.barrier()
    hvdp.shutdown()


if __name__ == "__main__":
    main()
