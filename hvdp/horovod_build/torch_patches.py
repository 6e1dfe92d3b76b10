"""The changes Horovod 0.28.1's torch extension needs on current torch; ``hvdp build`` applies them
(see :mod:`hvdp.horovod_build.patches`). What each change fixes is its ``why``."""

from __future__ import annotations

from hvdp.horovod_build.patch import Patch, insertion

#: The extension's CMake file.
CMAKE_PATCHES = (
    Patch("horovod/torch/CMakeLists.txt", "    set(CMAKE_CXX_STANDARD 14)", "    set(CMAKE_CXX_STANDARD 17)",
          "the torch extension re-selected C++14 for torch >= 1.5"),
)

#: horovod.torch's Python layer.
#: torch's extension's C++ sources need no change of their own.
SOURCE_PATCHES: tuple = ()

PYTHON_PATCHES = (
    Patch("horovod/torch/sync_batch_norm.py",
          "        # currently only GPU input is supported by underlying kernel from PyTorch\n"
          "        if not input.is_cuda:\n"
          "            raise ValueError('SyncBatchNorm expected input tensor to be on GPU')\n",
          "        # the sync below runs CUDA kernels; CPU tensors sum their statistics with an allreduce\n"
          "        if not input.is_cuda:\n"
          "            return cpu_sync_batch_norm(self, input)\n",
          "SyncBatchNorm refused CPU tensors, even in eval mode or on one process (Horovod's own synthetic "
          "benchmark failed with --no-cuda)"),
    Patch("horovod/torch/sync_batch_norm.py", "class _SyncBatchNorm(Function):\n",
          insertion("torch_sync_batch_norm").lstrip("\n") + "\n\nclass _SyncBatchNorm(Function):\n",
          "the CPU forward of SyncBatchNorm (hvdp/horovod_build/inserted/torch_sync_batch_norm.py)"),
)

#: Only a GPU build needs these (``hvdp build --gpu``).
GPU_PATCHES = (
    Patch("horovod/torch/cuda_util.cc",
          '  cudalib = dlopen("libcuda.so", RTLD_LAZY);\n'
          "  if (!cudalib) {\n"
          '    throw std::logic_error("Internal error. Could not dlopen libcuda.so.");\n',
          '  cudalib = dlopen("libcuda.so.1", RTLD_LAZY);\n'
          "  if (!cudalib) {\n"
          '    cudalib = dlopen("libcuda.so", RTLD_LAZY);\n'
          "  }\n"
          "  if (!cudalib) {\n"
          '    throw std::logic_error("Internal error. Could not dlopen libcuda.so.1 or libcuda.so.");\n',
          "the torch extension loads the driver as libcuda.so.1, the name the driver installs (and the "
          "CUDA runtime loads); libcuda.so is a development link that driver-only hosts and GPU "
          "containers often lack, and there the first GPU tensor failed 'Could not dlopen libcuda.so'"),
)
