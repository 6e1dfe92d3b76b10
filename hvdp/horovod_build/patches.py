"""The changes made to Horovod 0.28.1's source before it is compiled, in the order they apply.

Common to every build: C++17 instead of C++14 (torch >= 2.1 and TensorFlow's absl
headers need it), and two fixes to Horovod's Gloo controller (process sets' Gloo
contexts use ``HOROVOD_GLOO_IFACE``; the stall inspector sees every rank). Each
framework's own changes come from its :class:`~hvdp.backends.spec.FrameworkSpec`.

Every patch's text is part of the cache key (:func:`hvdp.horovod_build.cache.patches_digest`),
so the order below is part of it too: change it only with a rebuild in mind.
"""

from __future__ import annotations

from typing import Tuple

from hvdp.backends.registry import SPECS
from hvdp.backends.spec import Patch
from hvdp.backends.tensorflow_patches import KERAS3_PATCHES

__all__ = ["GPU_PATCHES", "KERAS3_PATCHES", "PATCHES", "PATCH_LEVEL", "Patch"]

#: Bump whenever the patches change in a way their text does not show, so cached wheels are rebuilt.
PATCH_LEVEL = 5

_CXX17 = Patch("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
               "current torch and TensorFlow headers need C++17")

_GLOO = (
    Patch("horovod/common/gloo/gloo_context.cc",
          "  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
          "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
          "  gloo_iface_ = global_context.gloo_iface_;\n"
          "  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
          "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
          "process-set Gloo contexts ignored HOROVOD_GLOO_IFACE and bound to the address the "
          "hostname resolves to, 127.0.1.1 on Debian hosts: multi-host Gloo jobs failed"),
    Patch("horovod/common/gloo/gloo_controller.cc", "  global_ranks_.reserve(size_);",
          "  global_ranks_.resize(size_);",
          "the Gloo controller's rank list stayed empty, so its stall inspector checked no rank "
          "and a stalled Gloo job hung forever"),
)

#: Every build's patches: the CMake files (top level, then each framework's extension), the
#: common C++ sources, then each framework's Python layer.
PATCHES: Tuple[Patch, ...] = (
    _CXX17,
    *(patch for spec in SPECS.values() for patch in spec.cmake_patches),
    *_GLOO,
    *(patch for spec in SPECS.values() for patch in spec.python_patches),
)

#: Changes only a GPU build needs (``hvdp build --gpu``); applied after PATCHES, and part of the
#: cache key of GPU builds only (:func:`hvdp.build.build_inputs`), so CPU builds keep their key.
#: Measured with CUDA 13.0 and NCCL 2.29 from PyPI's wheels: Horovod's CUDA kernels compile as they
#: are (C++11 suits nvcc 13.0, and the architectures are those nvcc lists, so none that CUDA 13 dropped).
GPU_PATCHES: Tuple[Patch, ...] = tuple(patch for spec in SPECS.values() for patch in spec.gpu_patches)
