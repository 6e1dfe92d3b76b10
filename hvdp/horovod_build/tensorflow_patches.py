"""The changes Horovod 0.28.1's TensorFlow and Keras layers need on TensorFlow >= 2.16 / Keras 3.

Unpatched, they fail on Keras 3 variables or, for the Keras DistributedOptimizer, train
without averaging. The larger insertions are modules in ``hvdp/horovod_build/inserted/``; what
each change fixes is its ``why``. ``hvdp build`` applies them (see :mod:`hvdp.horovod_build.patches`).
"""

from __future__ import annotations

from hvdp.horovod_build.patch import Patch
from hvdp.horovod_build.patch import insertion as _insertion

#: XLA ops (``xla_mpi_ops.cc``) need headers the TensorFlow wheel lacks: compiled only with ``hvdp build --xla``.
CMAKE_PATCHES = (
    Patch("horovod/tensorflow/CMakeLists.txt",
          'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")',
          'if("$ENV{HVDP_WITH_XLA_OPS}" STREQUAL "1")\n'
          '    list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n'
          'endif()',
          "XLA ops need headers the TensorFlow wheel does not ship; opt-in with --xla"),
)

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
          "Keras 3 DistributedOptimizer and load_model (hvdp/horovod_build/inserted/keras_optimizer.py)"),
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
          "what Horovod's Keras callbacks need under Keras 3 (hvdp/horovod_build/inserted/keras_callbacks.py)"),
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

_MPI_OPS = "horovod/tensorflow/mpi_ops.cc"

#: ``HvdpDirectAllreduce``: TensorFlow's gradients by the direct allreduce
#: (:data:`hvdp.horovod_build.direct_patches.DIRECT_ALLREDUCE`'s ``horovod_hvdp_direct_allreduce_from``), run by
#: the op's own thread on the job's Gloo context, outside Horovod's rounds (:mod:`hvdp.backends.tensorflow.direct`).
#: One flat float32/float64 tensor in, its sum over every rank times ``scale`` out. Stateful, so a traced
#: function runs its calls in the order they were traced, the same on every rank; CPU only. A timed-out call
#: prints Horovod's stall report lines (every other rank missing), which ``hvdp run`` reads.
DIRECT_OP = (
    Patch(_MPI_OPS, "\n} // namespace tensorflow\n} // namespace horovod\n",
          "\n// hvdp: the sum of every rank's tensor by the direct allreduce, times scale.\n"
          "class HvdpDirectAllreduceOp : public OpKernel {\n"
          "public:\n"
          "  explicit HvdpDirectAllreduceOp(OpKernelConstruction* context) : OpKernel(context) {\n"
          "    OP_REQUIRES_OK(context, context->GetAttr(\"channel\", &channel_));\n"
          "    OP_REQUIRES_OK(context, context->GetAttr(\"timeout_ms\", &timeout_ms_));\n"
          "  }\n"
          "\n"
          "  void Compute(OpKernelContext* context) override {\n"
          "    const Tensor& tensor = context->input(0);\n"
          "    const double scale = context->input(1).scalar<double>()();\n"
          "    Tensor* output = nullptr;\n"
          "    OP_REQUIRES_OK(context, context->allocate_output(0, tensor.shape(), &output));\n"
          "    const bool is_double = tensor.dtype() == DT_DOUBLE;\n"
          "    char error[1024] = {0};\n"
          "    const int code = common::horovod_hvdp_direct_allreduce_from(\n"
          "        tensor.tensor_data().data(), const_cast<char*>(output->tensor_data().data()),\n"
          "        (long long)tensor.NumElements(), is_double ? 1 : 0, (int)channel_, (long long)timeout_ms_, error,\n"
          "        (int)sizeof(error));\n"
          "    if (code == 1 &&\n"
          "        (std::strstr(error, \"imed out\") != nullptr || std::strstr(error, \"timeout\") != nullptr)) {\n"
          "      std::string report = \"[hvdp] One or more ranks stalled for \" +\n"
          "                           std::to_string(timeout_ms_ / 1000) +\n"
          "                           \" s in a direct allreduce (hvdp.direct.tf_gradients). Missing ranks:\\n\";\n"
          "      for (int r = 0; r < common::horovod_size(); ++r) {\n"
          "        if (r != common::horovod_rank()) {\n"
          "          report += std::to_string(r) + \"!: [allreduce.hvdp.direct.tf_gradients]\\n\";\n"
          "        }\n"
          "      }\n"
          "      std::fprintf(stderr, \"%s\", report.c_str());\n"
          "      std::fflush(stderr);\n"
          "    }\n"
          "    OP_REQUIRES(context, code != 2,\n"
          "                errors::FailedPrecondition(\"Horovod (hvdp's direct allreduce) needs a Gloo job\"));\n"
          "    OP_REQUIRES(context, code == 0,\n"
          "                errors::Unknown(\"Horovod (hvdp's direct gradient allreduce, \", tensor.NumElements(),\n"
          "                                \" elements) failed: \", error));\n"
          "    if (scale != 1.0) {\n"
          "      if (is_double) {\n"
          "        auto flat = output->flat<double>();\n"
          "        for (int64_t i = 0; i < flat.size(); ++i) flat(i) *= scale;\n"
          "      } else {\n"
          "        auto flat = output->flat<float>();\n"
          "        const float factor = (float)scale;\n"
          "        for (int64_t i = 0; i < flat.size(); ++i) flat(i) *= factor;\n"
          "      }\n"
          "    }\n"
          "  }\n"
          "\n"
          "private:\n"
          "  int64_t channel_ = 0;\n"
          "  int64_t timeout_ms_ = 0;\n"
          "};\n"
          "\n"
          "REGISTER_KERNEL_BUILDER(Name(\"HvdpDirectAllreduce\").Device(DEVICE_CPU), HvdpDirectAllreduceOp);\n"
          "\n"
          "REGISTER_OP(\"HvdpDirectAllreduce\")\n"
          "    .Attr(\"T: {float32, float64}\")\n"
          "    .Attr(\"channel: int\")\n"
          "    .Attr(\"timeout_ms: int\")\n"
          "    .Input(\"tensor: T\")\n"
          "    .Input(\"scale: float64\")\n"
          "    .Output(\"sum: T\")\n"
          "    .SetIsStateful()\n"
          "    .SetShapeFn([](shape_inference::InferenceContext* c) {\n"
          "      c->set_output(0, c->input(0));\n"
          "      return Status();\n"
          "    });\n"
          "\n} // namespace tensorflow\n} // namespace horovod\n",
          "hvdp's TensorFlow gradients by the direct allreduce, without Horovod's rounds"),
    Patch(_MPI_OPS, "#include <algorithm>\n",
          "#include <algorithm>\n#include <cstdio>\n#include <cstring>\n#include <string>\n",
          "the direct op's headers"),
)

#: Changes to the TensorFlow extension's C++ sources (after the common ones).
SOURCE_PATCHES = DIRECT_OP
#: horovod.tensorflow's and horovod.keras's Python layers.
PYTHON_PATCHES = KERAS3_PATCHES
#: A GPU build of TensorFlow's extension needs no change.
GPU_PATCHES: tuple = ()
