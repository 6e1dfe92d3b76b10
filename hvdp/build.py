"""Build Horovod 0.28.1 from its PyPI source for the frameworks installed, and cache the wheel.

Horovod 0.28.1 (the last release) does not build unchanged against current
PyTorch and TensorFlow. :func:`patch_source` makes exactly the changes they
require, each checked to apply once:

1. C++17 instead of C++14 (top-level CMakeLists.txt and the torch extension);
   torch >= 2.1 and TensorFlow's absl headers need C++17.
2. TensorFlow's XLA ops (``xla_mpi_ops.cc``) are compiled only when asked
   (``hvdp build --xla``): they need XLA headers the TensorFlow wheel lacks.
3. Gloo contexts of process sets (the global one included) use the network
   interface horovodrun chose (``HOROVOD_GLOO_IFACE``), as the other Gloo
   contexts do; unpatched, they bind to whatever the host name resolves to,
   which is a loopback address on Debian-style hosts (``127.0.1.1``), and a
   multi-host Gloo job dies with "connect [127.0.x.1]: Connection refused".
4. The Gloo controller sizes its list of global ranks (it only reserved room
   for it), so the stall inspector sees every rank; unpatched, under Gloo it
   never reports a stalled rank and never ends a stalled job.

The wheel is cached outside the repository under a key made of everything that
changes the binary, so a second build with the same inputs only reinstalls it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hvdp.errors import BuildError

HOROVOD_VERSION = "0.28.1"
SDIST_NAME = f"horovod-{HOROVOD_VERSION}.tar.gz"
SDIST_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
#: Bump whenever the patches below change, so cached wheels are rebuilt.
PATCH_LEVEL = 5
#: Python packages Horovod's setup.py imports (we build without isolation).
BUILD_REQUIREMENTS = ["cloudpickle", "psutil", "pyyaml", "packaging", "setuptools", "wheel"]
#: Where the record of the installed build lives, inside the horovod package.
BUILD_RECORD = "hvdp_build.json"
APT_FIX = "apt-get update && apt-get install -y {packages}"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Patch:
    """One textual change to Horovod's source, which must match exactly once."""

    path: str
    old: str
    new: str
    why: str


def _insertion(name: str) -> str:
    """The text of hvdp/horovod_patches/NAME.py, which a patch inserts into a Horovod module."""
    return "\n\n" + (Path(__file__).parent / "horovod_patches" / f"{name}.py").read_text()


_TF = "horovod/tensorflow/__init__.py"
_KERAS = "horovod/_keras/__init__.py"
_CALLBACKS = "horovod/_keras/callbacks.py"
_LR_GET = "self.backend.get_value(self.model.optimizer.lr)"

#: Horovod's TensorFlow and Keras layers on TensorFlow >= 2.16 / Keras 3 (unpatched, they fail
#: on Keras 3 variables or, for the Keras DistributedOptimizer, train without averaging).
KERAS3_PATCHES = (
    Patch("horovod/tensorflow/util.py",
          "    return refs.deref()\n",
          "    return refs.deref()\n" + _insertion("tf_util"),
          "as_tf_variable(): the tf.Variable behind a Keras 3 variable, which has no ref() or device"),
    Patch("horovod/tensorflow/util.py", "    return vars.ref()\n", "    return as_tf_variable(vars).ref()\n",
          "groups= of DistributedGradientTape/DistributedOptimizer accept Keras 3 variables"),
    Patch(_TF, "_make_subgraph, _cache, vars_to_refs, refs_to_vars\n",
          "_make_subgraph, _cache, vars_to_refs, refs_to_vars, as_tf_variable\n",
          "horovod.tensorflow uses as_tf_variable()"),
    Patch(_TF, "            gradients = super(self.__class__, self).gradient(target, sources, output_gradients)\n",
          "            sources = [as_tf_variable(s) for s in sources]\n"
          "            gradients = super(self.__class__, self).gradient(target, sources, output_gradients)\n",
          "DistributedGradientTape.gradient() on Keras 3 variables failed: 'Variable' object has no "
          "attribute 'ref' (horovod issue 4290)"),
    Patch(_TF, "self._local_sources.add(source.ref())", "self._local_sources.add(as_tf_variable(source).ref())",
          "register_local_source() and PartialDistributedGradientTape accept Keras 3 variables"),
    Patch(_TF, "is_local_source = s.ref() in self._local_sources if",
          "is_local_source = as_tf_variable(s).ref() in self._local_sources if",
          "get_local_and_global_gradients() accepts Keras 3 variables"),
    Patch("horovod/tensorflow/functions.py",
          "from horovod.tensorflow.util import _cache, _executing_eagerly, _make_subgraph\n",
          "from horovod.tensorflow.util import _cache, _executing_eagerly, _make_subgraph, as_tf_variable\n",
          "broadcast_variables uses as_tf_variable()"),
    Patch("horovod/tensorflow/functions.py", "    if inplace:\n        vars_by_device = {}\n",
          "    variables = [as_tf_variable(var) for var in variables]\n"
          "    if inplace:\n        vars_by_device = {}\n",
          "broadcast_variables() on Keras 3 variables failed (a tf.function received them as tensors "
          "it could not assign; inplace=True found no .device)"),
    Patch("horovod/tensorflow/sync_batch_norm.py",
          "    super(SyncBatchNormalization, self).__init__(fused=fused, **kwargs)\n",
          "    import inspect\n"
          "    if 'fused' in inspect.signature(tf.keras.layers.BatchNormalization.__init__).parameters:\n"
          "      super(SyncBatchNormalization, self).__init__(fused=fused, **kwargs)\n"
          "    else:  # Keras 3 has no fused kernel to turn off\n"
          "      super(SyncBatchNormalization, self).__init__(**kwargs)\n",
          "SyncBatchNormalization() failed on Keras 3: BatchNormalization no longer takes fused"),
    Patch("horovod/tensorflow/sync_batch_norm.py",
          "  def _moments(self, inputs, reduction_axes, keep_dims, **kwargs):\n"
          '    """Compute the mean and variance: it overrides the original _moments."""\n'
          "    worker_mean, worker_variance = super(SyncBatchNormalization, self)._moments(\n"
          "      inputs, reduction_axes, keep_dims=keep_dims, **kwargs)\n",
          "  def _moments(self, inputs, *args, **kwargs):\n"
          '    """Compute the mean and variance: it overrides the original _moments."""\n'
          "    # Keras 2 passes (reduction_axes, keep_dims), Keras 3 passes (mask).\n"
          "    worker_mean, worker_variance = super(SyncBatchNormalization, self)._moments(\n"
          "      inputs, *args, **kwargs)\n",
          "SyncBatchNormalization synchronizes its statistics with Keras 3's _moments(inputs, mask)"),
    Patch("horovod/tensorflow/sync_batch_norm.py",
          "  def call(self, *args, **kwargs):\n"
          "    outputs = super(SyncBatchNormalization, self).call(*args, **kwargs)\n",
          "  def call(self, inputs, training=None, **kwargs):\n"
          "    outputs = super(SyncBatchNormalization, self).call(inputs, training=training, **kwargs)\n",
          "SyncBatchNormalization could not be built on Keras 3, and would never have trained: Keras 3 reads "
          "the input's name and whether to pass training= from call()'s signature"),
    Patch(_KERAS, "class CallableList(list):",
          _insertion("keras_optimizer").lstrip("\n") + "\n\nclass CallableList(list):",
          "Keras 3 DistributedOptimizer and load_model (hvdp/horovod_patches/keras_optimizer.py)"),
    Patch(_KERAS, "    class _DistributedOptimizer(*optimizer.__class__.__bases__):\n",
          "    if is_keras3_optimizer(optimizer):\n"
          "        return create_keras3_distributed_optimizer(\n"
          "            optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,\n"
          "            gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,\n"
          "            groups, process_set, scale_local_gradients)\n\n"
          "    class _DistributedOptimizer(*optimizer.__class__.__bases__):\n",
          "horovod.tensorflow.keras.DistributedOptimizer on a Keras 3 optimizer trained without "
          "averaging gradients (model.fit and custom loops): it now reduces them in every update"),
    Patch(_KERAS, "    if legacy_opts:\n"
          "        keras_subclasses = keras.optimizers.legacy.Optimizer.__subclasses__()\n",
          "    if is_keras3(keras):\n"
          "        return load_keras3_model(keras, wrap_optimizer, filepath, custom_optimizers, custom_objects,\n"
          "                                 legacy_opts)\n"
          "    if legacy_opts:\n        keras_subclasses = keras.optimizers.legacy.Optimizer.__subclasses__()\n",
          "load_model() on Keras 3 wraps the loaded optimizer, its state kept (Keras 3 deserializes "
          "classes, not Horovod's factory functions)"),
    Patch(_CALLBACKS, "                  (epoch + 1, new_lr))\n",
          "                  (epoch + 1, new_lr))\n" + _insertion("keras_callbacks"),
          "what Horovod's Keras callbacks need under Keras 3 (hvdp/horovod_patches/keras_callbacks.py)"),
    Patch(_CALLBACKS, "        self._local_vars.add(var.ref())\n", "        self._local_vars.add(variable_ref(var))\n",
          "BroadcastGlobalVariablesCallback(local_variables=) accepts Keras 3 variables"),
    Patch(_CALLBACKS,
          "                broadcast_vars = [var for var in self.model.variables "
          "if var.ref() not in self._local_vars]\n"
          "                hvd.broadcast_variables(broadcast_vars,\n"
          "                                        root_rank=self.root_rank)\n"
          "                hvd.broadcast_variables(self.model.optimizer.variables(),\n",
          "                broadcast_vars = [var for var in self.model.variables\n"
          "                                  if variable_ref(var) not in self._local_vars]\n"
          "                hvd.broadcast_variables(broadcast_vars,\n"
          "                                        root_rank=self.root_rank)\n"
          "                hvd.broadcast_variables(optimizer_variables(self.model.optimizer),\n",
          "BroadcastGlobalVariablesCallback failed on Keras 3 ('list' object is not callable)"),
    Patch(_CALLBACKS, "    def on_batch_end(self, batch, logs=None):\n        if self.broadcast_done:\n",
          "    def on_train_begin(self, logs=None):\n"
          "        # Keras 3 can build the optimizer before the first step: broadcasting then makes the\n"
          "        # first step start from the root rank's state too (after it, that step differed).\n"
          "        if not self.broadcast_done and hvd._executing_eagerly() and keras3_prebuild(self.model):\n"
          "            self.on_batch_end(0, logs)\n\n"
          "    def on_batch_end(self, batch, logs=None):\n        if self.broadcast_done:\n",
          "BroadcastGlobalVariablesCallback broadcasts before the first step under Keras 3"),
    Patch(_CALLBACKS,
          f"        old_lr = {_LR_GET}\n"
          "        new_lr = self.initial_lr * self.multiplier(epoch)\n"
          "        self.backend.set_value(self.model.optimizer.lr, new_lr)\n\n"
          "        if hasattr(self.model.optimizer, 'momentum') and self.momentum_correction:\n",
          "        old_lr = self.backend.get_value(learning_rate_of(self.model.optimizer))\n"
          "        new_lr = self.initial_lr * self.multiplier(epoch)\n"
          "        self.backend.set_value(learning_rate_of(self.model.optimizer), new_lr)\n\n"
          "        if self.momentum_correction and momentum_is_variable(self.model.optimizer):\n",
          "learning rate callbacks set Keras 3's learning_rate (there is no lr) and skip momentum correction "
          "where Keras 3 compiled momentum as a constant, with a warning"),
    Patch(_CALLBACKS, f"            self.initial_lr = {_LR_GET}\n",
          "            self.initial_lr = self.backend.get_value(learning_rate_of(self.model.optimizer))\n",
          "learning rate callbacks read Keras 3's learning_rate"),
    Patch(_CALLBACKS, f"            logs['lr'] = {_LR_GET}\n",
          "            logs['lr'] = self.backend.get_value(learning_rate_of(self.model.optimizer))\n",
          "learning rate callbacks log Keras 3's learning_rate"),
    Patch(_CALLBACKS, f"            new_lr = {_LR_GET}\n",
          "            new_lr = self.backend.get_value(learning_rate_of(self.model.optimizer))\n",
          "the warmup callback reads Keras 3's learning_rate"),
    Patch("horovod/tensorflow/elastic.py",
          "    return model.built if hasattr(model, 'build') else True\n",
          "    return model.built if hasattr(model, 'build') else True\n\n\n"
          "def _optimizer_variables(optimizer, model):\n"
          "    # Keras 3: `variables` is a list (callable too once Horovod's DistributedOptimizer wrapped it),\n"
          "    # and an optimizer has its slots only once built (Keras 3 builds it at the first step): build it\n"
          "    # now, so that its whole state is saved and synced, also on a worker that joins before its first\n"
          "    # step (else it broadcasts fewer variables than the others, and the job deadlocks).\n"
          "    if not getattr(optimizer, 'built', True) and model is not None and hasattr(optimizer, 'build'):\n"
          "        optimizer.build(model.trainable_variables)\n"
          "    variables = optimizer.variables\n"
          "    return list(variables() if callable(variables) else variables)\n",
          "elastic KerasState failed on Keras 3 ('list' object is not callable), and deadlocked when a worker "
          "whose optimizer had not taken a step joined"),
    Patch("horovod/tensorflow/elastic.py", "        broadcast_variables(optimizer.variables(), root_rank=0)\n",
          "        broadcast_variables(_optimizer_variables(optimizer, model), root_rank=0)\n",
          "elastic KerasState.sync() broadcasts a Keras 3 optimizer's state"),
    Patch("horovod/tensorflow/elastic.py",
          "            self._saved_optimizer_state = [tf.identity(var) for var in self.optimizer.variables()]\n",
          "            self._saved_optimizer_state = [tf.identity(var) for var in\n"
          "                                           _optimizer_variables(self.optimizer, self.model)]\n",
          "elastic KerasState.commit() saves a Keras 3 optimizer's state"),
    Patch("horovod/tensorflow/elastic.py",
          "            for var, saved_var in zip(self.optimizer.variables(), self._saved_optimizer_state):\n",
          "            for var, saved_var in zip(_optimizer_variables(self.optimizer, self.model),\n"
          "                                      self._saved_optimizer_state):\n",
          "elastic KerasState.restore() restores a Keras 3 optimizer's state"),
    Patch("horovod/tensorflow/keras/callbacks.py", "from horovod._keras import callbacks as _impl\n",
          "from horovod._keras import callbacks as _impl\nK = _impl.keras2_backend(K)\n",
          "Horovod's Keras callbacks get get_value/set_value/constant, which keras.backend lost in Keras 3"),
    Patch("horovod/keras/callbacks.py", "from horovod._keras import callbacks as _impl\n",
          "from horovod._keras import callbacks as _impl\nK = _impl.keras2_backend(K)\n",
          "the same for horovod.keras's callbacks"),
    *(Patch(path,
            "        elif isinstance(local_variables, tf.Variable):\n"
            "            local_variables = [local_variables]\n"
            "        elif not all(isinstance(var, tf.Variable) for var in local_variables):\n",
            "        elif _impl.is_variable(local_variables):\n"
            "            local_variables = [local_variables]\n"
            "        elif not all(_impl.is_variable(var) for var in local_variables):\n",
            "BroadcastGlobalVariablesCallback(local_variables=) accepts Keras 3 variables")
      for path in ("horovod/tensorflow/keras/callbacks.py", "horovod/keras/callbacks.py")),
)


#: Horovod's torch layers on the CPU.
TORCH_PATCHES = (
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
          _insertion("torch_sync_batch_norm").lstrip("\n") + "\n\nclass _SyncBatchNorm(Function):\n",
          "the CPU forward of SyncBatchNorm (hvdp/horovod_patches/torch_sync_batch_norm.py)"),
)

PATCHES = (
    Patch("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
          "current torch and TensorFlow headers need C++17"),
    Patch("horovod/torch/CMakeLists.txt", "    set(CMAKE_CXX_STANDARD 14)", "    set(CMAKE_CXX_STANDARD 17)",
          "the torch extension re-selected C++14 for torch >= 1.5"),
    Patch("horovod/tensorflow/CMakeLists.txt",
          'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")',
          'if("$ENV{HVDP_WITH_XLA_OPS}" STREQUAL "1")\n'
          '    list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n'
          'endif()',
          "XLA ops need headers the TensorFlow wheel does not ship; opt-in with --xla"),
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
    *KERAS3_PATCHES,
    *TORCH_PATCHES,
)


#: Changes only a GPU build needs (``hvdp build --gpu``); applied after PATCHES, and part of the
#: cache key of GPU builds only (:func:`build_inputs`), so CPU builds keep their key. Measured with
#: CUDA 13.0 and NCCL 2.29 from PyPI's wheels: Horovod's CUDA kernels compile as they are (C++11
#: suits nvcc 13.0, and the architectures are those nvcc lists, so none that CUDA 13 dropped).
GPU_PATCHES: Tuple[Patch, ...] = (
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


@dataclass
class BuildOptions:
    """What to build. ``frameworks`` None means every supported one installed."""

    frameworks: Optional[Sequence[str]] = None
    gpu: bool = False
    xla: bool = False
    mpi: bool = True
    force: bool = False
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)


def cache_dir() -> Path:
    """``$HVDP_CACHE_DIR``, else ``$XDG_CACHE_HOME/hvdp``, else ``~/.cache/hvdp``."""
    explicit = os.environ.get("HVDP_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hvdp"


def dist_version(*names: str) -> Optional[str]:
    """The installed version of the first distribution found among ``names``."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def framework_versions() -> Dict[str, str]:
    """Installed frameworks Horovod can be built for, by hvdp name."""
    found = {
        "torch": dist_version("torch"),
        "tensorflow": dist_version("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"),
    }
    return {name: version for name, version in found.items() if version}


def _first_line(argv: List[str]) -> Optional[str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def mpi_version() -> Optional[str]:
    """``mpirun --version``'s first line, or None when MPI is not installed."""
    return _first_line(["mpirun", "--version"]) if shutil.which("mpirun") else None


def compiler() -> str:
    """The C++ compiler CMake will use."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or ""


def build_inputs(options: BuildOptions, frameworks: Dict[str, str]) -> Dict[str, object]:
    """Everything that affects the Horovod binary; the cache key is their hash."""
    cxx = compiler()
    return {
        "horovod": HOROVOD_VERSION,
        "patch_level": PATCH_LEVEL,
        "patches": patches_digest(PATCHES),  # a changed patch text (or inserted module) is a new build
        "python": f"{sys.implementation.cache_tag}-{platform.machine()}",
        "frameworks": dict(sorted(frameworks.items())),
        "mpi": mpi_version() if options.mpi else None,
        "gpu": options.gpu,
        "xla": options.xla,
        "compiler": _first_line([cxx, "--version"]) if cxx else None,
        **({"gpu_patches": patches_digest(GPU_PATCHES)} if options.gpu else {}),
    }


def patches_digest(patches: Sequence[Patch]) -> str:
    """A short hash of ``patches``' text: a changed patch changes the cache key of the builds it is in."""
    blob = json.dumps([[p.path, p.old, p.new] for p in patches]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_key(inputs: Dict[str, object]) -> str:
    """A short stable hash of the build inputs.

    Example:
        >>> cache_key({"horovod": "0.28.1"}) == cache_key({"horovod": "0.28.1"})
        True
    """
    blob = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_toolchain(options: BuildOptions) -> None:
    """Raise BuildError naming each missing tool and the command that installs it."""
    missing: List[str] = []
    packages: List[str] = []
    if not shutil.which("cmake"):
        missing.append("cmake")
        packages.append("cmake")
    if not compiler():
        missing.append("a C++ compiler (g++)")
        packages.append("g++")
    if options.mpi and not (shutil.which("mpicxx") and shutil.which("mpirun")):
        missing.append("MPI (mpirun and mpicxx)")
        packages += ["openmpi-bin", "libopenmpi-dev"]
    if missing:
        raise BuildError(
            f"Cannot build Horovod: {', '.join(missing)} not found. Fix: "
            f"{APT_FIX.format(packages=' '.join(packages))}"
            + ("  (or build without MPI: hvdp build --no-mpi)" if options.mpi else "")
        )


def _site_dir(module: str) -> Optional[Path]:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def framework_cuda_problems(frameworks: Dict[str, str]) -> List[str]:
    """One line per framework in ``frameworks`` that is not a CUDA build (each probed in its own process)."""
    problems: List[str] = []
    probe = {
        "torch": "import torch; print(torch.version.cuda or '')",
        "tensorflow": "import tensorflow as tf; print('1' if tf.test.is_built_with_cuda() else '')",
    }
    for name in frameworks:
        out = subprocess.run([sys.executable, "-c", probe[name]], capture_output=True, text=True, check=False)
        if out.returncode != 0 or not out.stdout.strip():
            problems.append(
                f"{name} {frameworks[name]} is not a CUDA build (install a CUDA build of {name}, "
                f"or leave it out: hvdp build --gpu --frameworks "
                f"{','.join(n for n in frameworks if n != name) or '<other>'})"
            )
    return problems


def _toolkit(environ: Mapping[str, str]) -> Tuple[Dict[str, str], List[str]]:
    problems: List[str] = []
    cuda_home = find_cuda_home(environ)
    if not cuda_home:
        problems.append("the CUDA toolkit (nvcc) was not found: install it (a CUDA 'devel' image has it) "
                        "or set CUDA_HOME")
    elif not (Path(cuda_home) / "bin" / "nvcc").is_file():
        problems.append(f"CUDA_HOME={cuda_home} has no bin/nvcc: point CUDA_HOME at the CUDA toolkit")
        cuda_home = None
    nccl_home = find_nccl_home(cuda_home, environ)
    if not nccl_home:
        problems.append("NCCL (nccl.h and libnccl) was not found: pip install nvidia-nccl-cu12, "
                        "or apt-get install libnccl-dev, or set HOROVOD_NCCL_HOME")
    if problems or not cuda_home or not nccl_home:
        return {}, problems
    return nccl_environment(cuda_home, nccl_home), []


def toolkit_environment(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Horovod's NCCL build settings for the CUDA toolkit and NCCL found from ``environ``.

    Raises BuildError naming what is missing. Does not look at the frameworks
    (:func:`gpu_environment` does both).
    """
    env, problems = _toolkit(os.environ if environ is None else environ)
    if problems:
        raise BuildError("Cannot build Horovod with --gpu:\n  - " + "\n  - ".join(problems))
    return env


def nccl_environment(cuda_home: str, nccl_home: str) -> Dict[str, str]:
    """The variables that make Horovod's build use NCCL ring all-reduce on CUDA.

    Example:
        >>> nccl_environment("/usr/local/cuda", "/usr")["HOROVOD_GPU_OPERATIONS"]
        'NCCL'
    """
    return {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_CUDA_HOME": cuda_home,
            "HOROVOD_NCCL_HOME": nccl_home, "HOROVOD_NCCL_LINK": "SHARED"}


def gpu_environment(frameworks: Dict[str, str], environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Horovod's NCCL build settings, or BuildError listing everything that is missing."""
    env, problems = _toolkit(os.environ if environ is None else environ)
    problems = framework_cuda_problems(frameworks) + problems
    if problems:
        raise BuildError("Cannot build Horovod with --gpu:\n  - " + "\n  - ".join(problems))
    return env


def find_cuda_home(environ: Mapping[str, str]) -> Optional[str]:
    """``CUDA_HOME`` (or ``HOROVOD_CUDA_HOME``), else the toolkit of the ``nvcc`` on ``PATH``, else
    that of PyPI's nvcc wheel in this environment (see :func:`pip_cuda_home`), else /usr/local/cuda."""
    explicit = environ.get("CUDA_HOME") or environ.get("HOROVOD_CUDA_HOME")
    if explicit:
        return explicit
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        if root.parent.name != "nvidia":  # a toolkit installed as such, not a pip wheel's folder
            return str(root)
        return pip_cuda_home(root.parent)
    nvidia = _site_dir("nvidia")
    from_pip = pip_cuda_home(nvidia) if nvidia else None
    if from_pip:
        return from_pip
    return "/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").exists() else None


#: Folders of PyPI's CUDA wheels (under site-packages/nvidia) that hold parts of the toolkit.
#: CUDA 13's wheels (nvidia-cuda-nvcc, -runtime, -cccl, -crt, nvidia-nvvm) all unpack into
#: one folder, ``nvidia/cu13``; CUDA 12's each have their own (``cuda_nvcc``, ``cuda_runtime``, ...).
_PIP_CUDA_FOLDER = re.compile(r"cu\d+|cuda_\w+")


def pip_cuda_roots(nvidia: Path) -> List[Path]:
    """The folders under ``nvidia`` that make a CUDA toolkit, the one with ``bin/nvcc`` first.

    Empty when no nvcc wheel is installed. When several CUDA versions are (``cu12``,
    ``cu13``), the newest one that has nvcc and only it.
    """
    if not nvidia.is_dir():
        return []
    folders = sorted(p for p in nvidia.iterdir() if p.is_dir() and _PIP_CUDA_FOLDER.fullmatch(p.name))
    versioned = [p for p in folders if p.name.startswith("cu") and not p.name.startswith("cuda_")]
    with_nvcc = [p for p in versioned if (p / "bin" / "nvcc").is_file()]
    if with_nvcc:
        return [max(with_nvcc, key=lambda p: int(p.name[2:]))]
    split = [p for p in folders if p.name.startswith("cuda_")]
    nvcc = [p for p in split if (p / "bin" / "nvcc").is_file()]
    return nvcc + [p for p in split if p not in nvcc] if nvcc else []


def pip_cuda_home(nvidia: Path) -> Optional[str]:
    """A CUDA_HOME made of links to PyPI's CUDA wheels under ``nvidia``, or None without nvcc.

    The wheels are not laid out as a toolkit: their libraries are in ``lib`` (CMake
    and torch look in ``lib64``) and only versioned (``libcudart.so.13``, no
    ``libcudart.so`` to link with), and CUDA 12's are split over several folders.
    The folder, in the cache and named by the wheels' location, has ``bin``,
    ``nvvm`` and ``include`` with a link per entry, and ``lib64`` (``lib`` links to
    it) with a link per library plus ``libX.so`` for each ``libX.so.N``.
    """
    roots = pip_cuda_roots(nvidia)
    if not roots:
        return None
    tag = hashlib.sha256("\n".join(str(p) for p in roots).encode()).hexdigest()[:12]
    return str(assemble_cuda_home(roots, cache_dir() / "cuda" / f"{roots[0].name}-{tag}"))


def assemble_cuda_home(roots: Sequence[Path], home: Path) -> Path:
    """Fill ``home`` with links to the toolkit parts in ``roots`` (the first one wins a name)."""
    if home.is_symlink() or home.is_file():
        home.unlink()
    elif home.exists():
        shutil.rmtree(home)
    for part in ("bin", "nvvm", "include", "lib64"):
        (home / part).mkdir(parents=True)
    (home / "lib").symlink_to("lib64")
    for root in roots:
        for part, into in (("bin", "bin"), ("nvvm", "nvvm"), ("include", "include"), ("lib", "lib64"),
                           ("lib64", "lib64")):
            source = root / part
            if not source.is_dir() or source.is_symlink():
                continue
            for entry in sorted(source.iterdir()):
                link = home / into / entry.name
                if not (link.exists() or link.is_symlink()):
                    link.symlink_to(entry)
    for library in sorted((home / "lib64").glob("lib*.so.*")):
        plain = library.parent / (library.name.split(".so.")[0] + ".so")
        if not (plain.exists() or plain.is_symlink()):
            plain.symlink_to(library.name)
    return home


def find_nccl_home(cuda_home: Optional[str], environ: Mapping[str, str]) -> Optional[str]:
    """A folder with include/nccl.h and lib/libnccl.so.

    Looked for in ``HOROVOD_NCCL_HOME`` (or ``NCCL_HOME``), then the NCCL of
    PyTorch's CUDA wheels (package nvidia-nccl-cu*), /usr (Debian's
    libnccl-dev), and the CUDA toolkit. The pip NCCL ships only
    ``libnccl.so.2``; CMake looks for ``libnccl.so``, so a folder of links is
    made in the cache for it.
    """
    explicit = environ.get("HOROVOD_NCCL_HOME") or environ.get("NCCL_HOME")
    if explicit:
        return explicit
    nvidia = _site_dir("nvidia")
    candidates = ([nvidia / "nccl"] if nvidia else []) + [Path("/usr"), Path(cuda_home or "/usr/local/cuda")]
    for home in candidates:
        if not (home / "include" / "nccl.h").exists():
            continue
        libs = [home / "lib", home / "lib" / "x86_64-linux-gnu", home / "lib64"]
        if any((lib / "libnccl.so").exists() for lib in libs):
            return str(home)
        versioned = sorted(p for lib in libs for p in lib.glob("libnccl.so.*"))
        if versioned:
            linked = cache_dir() / "nccl"
            (linked / "lib").mkdir(parents=True, exist_ok=True)
            for link, target in ((linked / "include", home / "include"), (linked / "lib" / "libnccl.so", versioned[0])):
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(target)
            return str(linked)
    return None


def build_environment(options: BuildOptions, frameworks: Dict[str, str], environ: Mapping[str, str],
                      gpu_env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment ``pip wheel`` builds Horovod in: ``environ`` plus hvdp's settings.

    ``gpu_env`` (from :func:`gpu_environment`) is required with ``options.gpu``.

    Example:
        >>> env = build_environment(BuildOptions(jobs=2), {"torch": "2.13.0"}, {})
        >>> env["HOROVOD_WITH_PYTORCH"], env["HOROVOD_WITHOUT_TENSORFLOW"], env["MAKEFLAGS"]
        ('1', '1', '-j2')
    """
    if options.gpu and not gpu_env:
        raise BuildError("build_environment: --gpu needs the NCCL settings of gpu_environment().")
    env = dict(environ)
    if options.gpu and gpu_env:
        env.update(gpu_env)
        # torch.utils.cpp_extension (which Horovod's CMake asks whether torch has CUDA) reads CUDA_HOME.
        env["CUDA_HOME"] = gpu_env["HOROVOD_CUDA_HOME"]
    env.update({
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "MAKEFLAGS": f"-j{options.jobs}",
        "HVDP_WITH_XLA_OPS": "1" if options.xla else "0",
    })
    env["HOROVOD_WITH_MPI" if options.mpi else "HOROVOD_WITHOUT_MPI"] = "1"
    for name, flag in (("torch", "PYTORCH"), ("tensorflow", "TENSORFLOW")):
        env[f"HOROVOD_WITH_{flag}" if name in frameworks else f"HOROVOD_WITHOUT_{flag}"] = "1"
    return env


def wheel_command(source: Path, out: Path) -> List[str]:
    """The command that compiles Horovod's patched ``source`` into a wheel in ``out``.

    Without build isolation: Horovod's build imports the installed torch and TensorFlow.
    """
    return _pip("wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(out), str(source))


def fetch_sdist(progress: Progress) -> Path:
    """Horovod's source distribution, downloaded once and checked against its hash."""
    target = cache_dir() / "sdist"
    path = target / SDIST_NAME
    if not path.exists():
        target.mkdir(parents=True, exist_ok=True)
        progress(f"Downloading {SDIST_NAME} from PyPI ...")
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"horovod=={HOROVOD_VERSION}", "-d", str(target)],
            capture_output=True, text=True, check=False,
        )
        if result.returncode != 0 or not path.exists():
            raise BuildError(
                f"Could not download horovod=={HOROVOD_VERSION} source from PyPI:\n"
                f"{result.stderr.strip()[-2000:]}\nFix: check the network, or put {SDIST_NAME} in {target}."
            )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise BuildError(
            f"{path} has sha256 {digest}, expected {SDIST_SHA256}. "
            f"Delete it and run hvdp build again."
        )
    return path


def patch_source(root: Path, patches: Sequence[Patch] = PATCHES) -> List[str]:
    """Apply ``patches`` under ``root``; each must match exactly once. Returns what changed."""
    done = []
    for patch in patches:
        path = root / patch.path
        text = path.read_text()
        count = text.count(patch.old)
        if count != 1:
            raise BuildError(
                f"Cannot patch {patch.path}: expected the line {patch.old!r} once, found it "
                f"{count} times. This hvdp supports horovod=={HOROVOD_VERSION} sources only."
            )
        path.write_text(text.replace(patch.old, patch.new))
        done.append(f"{patch.path}: {patch.why}")
    return done


def _run_logged(argv: List[str], env: Dict[str, str], log: Path, progress: Progress, every: float = 30.0) -> None:
    """Run ``argv`` with its output in ``log``, reporting progress; BuildError on failure."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        last = start
        while proc.poll() is None:
            time.sleep(1.0)
            if time.monotonic() - last >= every:
                last = time.monotonic()
                steps = re.findall(r"\[\s*(\d+)%\]", log.read_text(errors="replace")[-20000:])
                where = f", compiling {steps[-1]}%" if steps else ""
                progress(f"  ... {time.monotonic() - start:.0f} s{where} (log: {log})")
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise BuildError(f"Building Horovod failed (exit {proc.returncode}). Last lines of {log}:\n{tail}")


def _pip(*args: str) -> List[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]


def install_wheel(wheel: Path, record: Dict[str, object], progress: Progress) -> None:
    """Install ``wheel`` into this Python and leave a record of the build beside it."""
    progress(f"Installing {wheel.name} ...")
    result = subprocess.run(_pip("install", "-q", "--no-deps", "--force-reinstall", str(wheel)),
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"pip could not install {wheel}:\n{result.stderr.strip()[-2000:]}")
    package = _site_dir("horovod")
    if package is None:
        raise BuildError(f"{wheel.name} installed but horovod cannot be found by {sys.executable}.")
    (package / BUILD_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))


def installed_record() -> Optional[Dict[str, object]]:
    """The record ``hvdp build`` left beside the installed Horovod, if any."""
    package = _site_dir("horovod")
    if package is None or not (package / BUILD_RECORD).exists():
        return None
    loaded: Dict[str, object] = json.loads((package / BUILD_RECORD).read_text())
    return loaded


def build(options: BuildOptions, progress: Progress = print) -> Path:
    """Build (or reuse from cache) and install Horovod; return the wheel's path.

    Example:
        >>> build(BuildOptions(frameworks=["torch"]))  # doctest: +SKIP
    """
    installed = framework_versions()
    wanted = list(options.frameworks) if options.frameworks else list(installed)
    for name in wanted:
        if name not in ("torch", "tensorflow"):
            raise BuildError(f"Unknown framework {name!r} for --frameworks. Expected: torch, tensorflow.")
        if name not in installed:
            raise BuildError(
                f"{name} is not installed, so Horovod cannot be built for it. Install it "
                f"(pip install 'hvdp[{name}]') or leave it out of --frameworks."
            )
    if not wanted:
        raise BuildError("Neither torch nor tensorflow is installed: install one first, "
                         "e.g. pip install 'hvdp[torch]'.")
    frameworks = {name: installed[name] for name in wanted}
    inputs = build_inputs(options, frameworks)
    key = cache_key(inputs)
    slot = cache_dir() / "wheels" / key
    wheels = sorted(slot.glob("horovod-*.whl")) if slot.exists() else []
    progress(f"Horovod {HOROVOD_VERSION} for {', '.join(f'{n} {v}' for n, v in frameworks.items())}"
             f"{' + NCCL' if options.gpu else ''}; cache key {key}")
    if wheels and not options.force:
        progress(f"Cache hit: {wheels[0]}")
        current = installed_record()
        if current is not None and current.get("key") == key:
            progress("Already installed in this environment; nothing to do (--force rebuilds).")
            return wheels[0]
        install_wheel(wheels[0], {"key": key, "inputs": inputs, "wheel": str(wheels[0])}, progress)
        return wheels[0]

    check_toolchain(options)
    gpu_env = gpu_environment(frameworks) if options.gpu else None
    env = build_environment(options, frameworks, os.environ, gpu_env)

    sdist = fetch_sdist(progress)
    progress("Installing build requirements ...")
    subprocess.run(_pip("install", "-q", *BUILD_REQUIREMENTS), check=True, capture_output=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvdp-build-") as tmp:
        with tarfile.open(sdist) as archive:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 (and 3.8-3.10 security releases)
                archive.extractall(tmp, filter="data")
            else:  # Debian 12's Python 3.11.2: the sdist's hash was checked in fetch_sdist
                archive.extractall(tmp)
        source = Path(tmp) / f"horovod-{HOROVOD_VERSION}"
        for change in patch_source(source) + (patch_source(source, GPU_PATCHES) if options.gpu else []):
            progress(f"Patched {change}")
        out = Path(tmp) / "wheel"
        log = cache_dir() / "logs" / f"build-{key}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        progress(f"Compiling with {options.jobs} jobs (a few minutes on 2 cores) ...")
        _run_logged(wheel_command(source, out), env, log, progress)
        built = sorted(out.glob("horovod-*.whl"))
        if not built:
            raise BuildError(f"pip wheel finished but left no wheel in {out}; see {log}.")
        slot.mkdir(parents=True, exist_ok=True)
        wheel = slot / built[0].name
        shutil.copy2(built[0], wheel)
    seconds = time.monotonic() - start
    record = {"key": key, "inputs": inputs, "wheel": str(wheel), "build_seconds": round(seconds, 1)}
    (slot / "build.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    progress(f"Built {wheel.name} in {seconds:.0f} s; cached in {slot}")
    install_wheel(wheel, record, progress)
    return wheel
