# Inserted at the end of horovod/torch/sync_batch_norm.py by hvdp's build: SyncBatchNorm on CPU tensors.


import itertools as _itertools
from typing import Any

import torch
from horovod.torch.mpi_ops import Sum, size
from horovod.torch.mpi_ops import allreduce as _allreduce
from torch.nn.modules.batchnorm import _BatchNorm

_cpu_layers = _itertools.count()


def cpu_sync_batch_norm(layer: Any, input: torch.Tensor) -> torch.Tensor:
    """``layer``'s forward on CPU tensors, where the CUDA kernels of Horovod's sync do not run.

    Each rank's per-channel sum, sum of squares and count are summed over the
    ranks with Horovod's differentiable allreduce, so that forward and backward
    equal one BatchNorm over the union of the ranks' batches (running statistics
    too, with the unbiased variance). Without batch statistics (eval mode with
    running statistics) or on one process there is nothing to sync.
    """
    layer._check_input_dim(input)
    if not (layer.training or not layer.track_running_stats) or size() == 1:
        return _BatchNorm.forward(layer, input)
    name = getattr(layer, "_cpu_sync_name", None)
    if name is None:  # layers run in the same order on every rank, so the names match across ranks
        name = layer._cpu_sync_name = f"sync_batch_norm.cpu.{next(_cpu_layers)}"
    channels = input.size(1)
    dims = [0, *range(2, input.dim())]
    count = input.new_full((1,), float(input.numel() // channels))
    total = _allreduce(torch.cat([input.sum(dims), (input * input).sum(dims), count]), op=Sum, name=name)
    n = total[-1]
    mean = total[:channels] / n
    var = total[channels:2 * channels] / n - mean * mean
    if layer.training and layer.track_running_stats:
        with torch.no_grad():
            layer.num_batches_tracked += 1
            momentum = layer.momentum if layer.momentum is not None else 1.0 / float(layer.num_batches_tracked)
            layer.running_mean.mul_(1 - momentum).add_(momentum * mean)
            layer.running_var.mul_(1 - momentum).add_(momentum * var * n / (n - 1))
    shape = [1, channels] + [1] * (input.dim() - 2)
    out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + layer.eps)
    if layer.affine:
        out = out * layer.weight.view(shape) + layer.bias.view(shape)
    return out
