"""Horovod settings hvdp sets for a job when the user has not set them.

Measured by ``hvdp bench`` on a 2-core CPU machine (np=2, one thread per rank,
the reference CNN, batch 32; contenders alternated, medians of 3 runs of 25
steps). Each value says what was measured. Every one is overridable: a
variable already in the environment is left alone (``hvdp run --dry-run``
shows what hvdp adds).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

#: Milliseconds between two rounds of Horovod's background loop. Horovod's default is 1 ms;
#: every round runs a cache-coordination allreduce between all ranks even when idle, which
#: on a CPU job takes cycles from the compute threads; a longer cycle delays the last
#: gradients of a step instead. Step time (rank 0 CPU time per step), torch/cnn np=2 Gloo,
#: two sweeps, medians of 3 alternated runs: 1 ms 108.4 (101.6) ms, 2.5 ms 103.4 (99.8),
#: 5 ms 101.0 (92.6) and 98.4 (93.8), 10 ms 103.6 (92.2); plain Horovod 113.9 / 110.9; a third
#: sweep: 1 ms 108.2, 2 ms 107.6, 3 ms 104.6, 5 ms 104.4, plain Horovod 110.0. The cost: a model whose
#: step is a few ms (the 64-tensor MLP, torch, 2 runs) waits longer for its gradients: 1 ms 11.06,
#: 2 ms 11.97, 3 ms 12.13, 5 ms 13.84, plain Horovod 11.69 ms. Such jobs should set HOROVOD_CYCLE_TIME=1.
CPU_CYCLE_TIME_MS = "5"

#: Under --mpi, Open MPI busy-polls while a rank waits in a collective, and Horovod's
#: background thread waits in one every cycle: with as many ranks as cores that poll runs
#: on the cores the compute threads need. Yielding when idle gives them back. Step time
#: (rank 0 CPU per step), torch/cnn np=2 MPI, medians of 3 alternated runs: cycle 1 ms
#: 141.6 (141.2) ms, cycle 5 ms 113.0 (104.0), cycle 5 ms + yield 94.4 (89.0); plain
#: Horovod 129.0 (128.8); DDP/Gloo 92.4 in the Gloo sweep.
MPI_YIELD_WHEN_IDLE = "1"


#: glibc gives each allocation of 32 MB or more its own fresh mapping and unmaps it on free, and
#: hands freed memory at the top of its heap back to the system once 128 KB of it pile up (the
#: threshold it uses once the first is set). A training step frees and allocates its activations
#: and gradients every step, so each step faulted them in and zeroed them page by page again (13% of
#: the CPU of a torch CNN job was the kernel's page-fault path). Keeping blocks up to 128 MB in the
#: heap, and up to 256 MB of free memory at its top, ends that. Measured (np=2, 2 alternated runs
#: each, ms per step): torch/cnn hvdp 122.1 / 129.2 with neither, 119.8 / 121.6 with only a mapping
#: threshold, 100.4 / 98.6 with both; DDP under torchrun gains as much from them (102 -> 88). A 64 MB
#: torch tensor allocated and filled 20 times (one process): 16385 minor page faults and 41.2 ms per
#: tensor by default, 4096 and 14.4 ms with the mapping threshold. The cost: up to 256 MB of freed
#: memory per process stays mapped. glibc ignores a mapping threshold over 256 MB.
MALLOC_MMAP_THRESHOLD = str(128 << 20)
MALLOC_TRIM_THRESHOLD = str(256 << 20)

#: torch's CPU allocator, with THP_MEM_ALLOC_ENABLE=1, aligns each block of 2 MB or more on 2 MB and
#: asks for transparent huge pages there (madvise), so a fresh block faults in 2 MB pages, not 4 KB
#: ones. The heap settings above keep freed blocks for reuse, but a heap the job's small allocations
#: cut up still serves big tensors from fresh memory: one process allocating and filling a 64 MB
#: tensor faulted 16384 pages each time without it, 544 with it. Measured (np=2 Gloo, 64 MB float32,
#: ``hvdp.allreduce(t)`` returning a new tensor with a barrier between calls, medians of 10 calls,
#: 2 alternated runs each): 109.6 / 100.0 ms without, 71.2 / 68.3 ms with (``out=`` 74-84 ms in both).
#: Back to back (``hvdp bench --quick --only allreduce``, 3 alternated runs) and in training (torch
#: CNN and ResNet-18, hvdp and DDP, 3 alternated runs of 20 steps) it changed nothing beyond the
#: noise: new-result 64 MB 72-81 ms without, 74-83 with; step time ratios with / without 0.99-1.05.
#: The cost: a block of 2 MB or more takes whole 2 MB pages (ResNet-18 with Adam, peak RSS per rank
#: 611-614 MB without, 612-619 with). Only where the kernel's transparent_hugepage mode is madvise
#: or always; TensorFlow ignores it.
TORCH_THP = "1"


def horovod_defaults(controller: str, framework: Optional[str], local: bool,
                     environ: Mapping[str, str]) -> Dict[str, str]:
    """The Horovod environment hvdp adds for a job, leaving out what ``environ`` already sets.

    Only local jobs (one machine, where the values were measured) get them; on
    hosts given with -H, a hostfile or Slurm, Horovod's own defaults apply.

    Example:
        >>> sorted(horovod_defaults("gloo", "torch", True, {}).items())  # doctest: +NORMALIZE_WHITESPACE
        [('HOROVOD_CYCLE_TIME', '5'), ('MALLOC_MMAP_THRESHOLD_', '134217728'),
         ('MALLOC_TRIM_THRESHOLD_', '268435456'), ('THP_MEM_ALLOC_ENABLE', '1')]
        >>> horovod_defaults("mpi", "torch", False, {})
        {}
    """
    chosen: Dict[str, str] = {}
    if local:
        chosen["HOROVOD_CYCLE_TIME"] = CPU_CYCLE_TIME_MS
        chosen["MALLOC_MMAP_THRESHOLD_"] = MALLOC_MMAP_THRESHOLD
        chosen["MALLOC_TRIM_THRESHOLD_"] = MALLOC_TRIM_THRESHOLD
        chosen["THP_MEM_ALLOC_ENABLE"] = TORCH_THP
        if controller == "mpi":
            chosen["OMPI_MCA_mpi_yield_when_idle"] = MPI_YIELD_WHEN_IDLE
    return {var: value for var, value in chosen.items() if var not in environ}
