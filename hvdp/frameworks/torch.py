"""PyTorch as ``hvdp build`` and ``hvdp doctor`` see it (the backend itself is :mod:`hvdp.backends.torch`)."""

from __future__ import annotations

from hvdp.frameworks.spec import FrameworkSpec

SPEC = FrameworkSpec(
    name="torch",
    distributions=("torch",),
    requirement="torch==2.13.0",
    horovod_flag="PYTORCH",
    horovod_module="horovod.torch",
    backend_module="hvdp.backends.torch",
    cuda_probe="import torch; print(torch.version.cuda or '')",
    gpu_count_probe="import torch; facts['gpus'] = torch.cuda.device_count()",
    bench_native="ddp",  # DistributedDataParallel over Gloo, under torchrun
)
