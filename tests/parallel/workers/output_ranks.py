"""What each rank writes, for hvdp run's output modes: rank 0 a line, a redrawn progress line and
a line on stderr; rank 1 one line on stdout and one on stderr; both TensorFlow's start-up lines
first (as TensorFlow writes them, to stderr, before hvdp.init)."""

from __future__ import annotations

import sys

NOISE = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
         "I0000 00:00:1796116390.501697   27002 port.cc:153] oneDNN custom operations are on. You may see slightly "
         "different numerical results due to floating-point round-off errors from different computation orders. "
         "To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n")


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
        sys.stderr.write("\n")
    else:
        print(f"hello from rank {rank}", flush=True)
        print(f"warning from rank {rank}", file=sys.stderr, flush=True)
    hvdp.barrier()
    hvdp.shutdown()


if __name__ == "__main__":
    main()
