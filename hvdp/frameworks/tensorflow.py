"""TensorFlow as ``hvdp build`` and ``hvdp doctor`` see it (the backend itself is :mod:`hvdp.backends.tensorflow`)."""

from __future__ import annotations

from hvdp.frameworks.spec import FrameworkSpec

SPEC = FrameworkSpec(
    name="tensorflow",
    distributions=("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"),
    requirement="tensorflow-cpu==2.21.0",
    horovod_flag="TENSORFLOW",
    horovod_module="horovod.tensorflow",
    backend_module="hvdp.backends.tensorflow",
    cuda_probe="import tensorflow as tf; print('1' if tf.test.is_built_with_cuda() else '')",
    gpu_count_probe="import tensorflow as tf; facts['gpus'] = len(tf.config.list_physical_devices('GPU'))",
    bench_native="mwms",  # tf.distribute.MultiWorkerMirroredStrategy, one TF_CONFIG worker per process
    bench_env=(("KERAS_BACKEND", "tensorflow"), ("TF_CPP_MIN_LOG_LEVEL", "2")),
)
