"""torch's direct path: collectives on Horovod's own Gloo context (or, for the calls under MPI, on duplicates of
the job's MPI communicator), without the rounds of its background loop.

TensorFlow's counterpart has the same name, :mod:`hvdp.backends.tensorflow.direct`, so that one is found from
the other. There it is one module, as the build's op runs a whole allreduce inside the traced step; on torch,
Python drives the calls, so the path is a package:

- :mod:`.gradients`: the steady-state gradient path (fixed buckets, each allreduced as it fills, no rounds);
- :mod:`.buckets`: how a learnt order of gradients is cut into buckets, and one bucket's places and buffer;
- :mod:`.allreduce`: the build's C entries on torch (or their MPI peer, :mod:`hvdp.backends.direct_mpi`:
  :func:`~.allreduce.controller` picks), the direct allreduce (Gloo's ring, or shared memory), its
  sender threads (one per lane), and a Keras optimizer's gradients reduced together (``DirectGroup``);
- :mod:`.calls`: ``hvdp.allreduce`` by direct calls, and the header every whole-job collective starts with;
- :mod:`.shm`: the allreduce between the ranks of one machine through shared memory.

What every framework's direct path shares (the switch, the stall timeout, the quiet loop):
:mod:`hvdp.backends.direct`.
"""
