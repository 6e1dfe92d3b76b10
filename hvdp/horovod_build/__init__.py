"""The parts of ``hvdp build`` (:mod:`.build`, the orchestrator), by what changes together.

* :mod:`.source`: Horovod's sdist, downloaded, checked, unpacked and patched.
* :mod:`.patches`: the changes to Horovod's source, in the order they apply (part of the cache key):
  every build's, then :mod:`.torch_patches` and :mod:`.tensorflow_patches`; :mod:`.patch` is one change,
  and ``inserted/`` holds the modules a change inserts into Horovod's.
* :mod:`.toolchain`: CMake, the C++ compiler and MPI on this machine.
* :mod:`.cuda`: the CUDA toolkit and NCCL for ``hvdp build --gpu``.
* :mod:`.cache`: where wheels are kept, and the key they are found by.
* :mod:`.steps`: the build environment, compiling the wheel, installing it.
* :mod:`.options` and :mod:`.command`: what is asked for, and ``hvdp build`` as a command.
"""
