"""PyTorch as ``hvdp build`` and ``hvdp doctor`` see it (the backend itself is :mod:`hvdp.backends.torch`)."""

from __future__ import annotations

from hvdp.backends.spec import FrameworkSpec, Patch, insertion

SPEC = FrameworkSpec(
    name="torch",
    distributions=("torch",),
    requirement="torch==2.13.0",
    horovod_flag="PYTORCH",
    horovod_module="horovod.torch",
    backend_module="hvdp.backends.torch",
    cmake_patches=(
        Patch("horovod/torch/CMakeLists.txt", "    set(CMAKE_CXX_STANDARD 14)", "    set(CMAKE_CXX_STANDARD 17)",
              "the torch extension re-selected C++14 for torch >= 1.5"),
    ),
    python_patches=(
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
              "the CPU forward of SyncBatchNorm (hvdp/horovod_patches/torch_sync_batch_norm.py)"),
    ),
    gpu_patches=(
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
    ),
    cuda_probe="import torch; print(torch.version.cuda or '')",
    gpu_count_probe="import torch; facts['gpus'] = torch.cuda.device_count()",
    bench_native="ddp",  # DistributedDataParallel over Gloo, under torchrun
)
