"""The parts of ``hvdp build`` (:mod:`hvdp.build`), by what changes together.

* :mod:`.source`: Horovod's sdist, downloaded, checked, unpacked and patched.
* :mod:`.patches`: the changes to Horovod's source, in the order they apply (part of the cache key).
* :mod:`.toolchain`: CMake, the C++ compiler and MPI on this machine.
* :mod:`.cuda`: the CUDA toolkit and NCCL for ``hvdp build --gpu``.
* :mod:`.cache`: where wheels are kept, and the key they are found by.
* :mod:`.steps`: the build environment, compiling the wheel, installing it.
* :mod:`.options` and :mod:`.command`: what is asked for, and ``hvdp build`` as a command.
"""
