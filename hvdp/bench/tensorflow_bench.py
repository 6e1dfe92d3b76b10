"""``hvdp bench`` in TensorFlow/Keras 3: its models, and training one under each contender (imported by the
bench's TensorFlow processes only; Keras and TensorFlow are imported when a model is built)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from hvdp.bench import models, timing
from hvdp.bench.models import CLASSES, MLP_LAYERS, MLP_WIDTH, MODELS


def build_model(name: str) -> Any:
    """The Keras 3 model named ``name`` (one of :data:`hvdp.bench.models.MODELS`; channels-last inputs)."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)
    if name == "cnn":
        return keras.Sequential([
            keras.Input((32, 32, 3)),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
            layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
            layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dense(CLASSES),
        ])
    if name == "mlp":
        stack = [keras.Input((MLP_WIDTH,))]
        stack += [layers.Dense(MLP_WIDTH, activation="relu") for _ in range(MLP_LAYERS - 1)]
        return keras.Sequential([*stack, layers.Dense(CLASSES)])
    if name == "resnet18":
        inputs = keras.Input((32, 32, 3))
        x = layers.Conv2D(64, 7, 2, padding="same", use_bias=False)(inputs)
        x = layers.MaxPooling2D(3, 2, padding="same")(layers.ReLU()(layers.BatchNormalization()(x)))
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            for block_stride in (stride, 1):
                out = layers.Conv2D(cout, 3, block_stride, padding="same", use_bias=False)(x)
                out = layers.ReLU()(layers.BatchNormalization()(out))
                out = layers.BatchNormalization()(layers.Conv2D(cout, 3, 1, padding="same", use_bias=False)(out))
                short = x
                if block_stride != 1 or cin != cout:
                    short = layers.BatchNormalization()(layers.Conv2D(cout, 1, block_stride, use_bias=False)(x))
                x = layers.ReLU()(layers.Add()([out, short]))
                cin = cout
        x = layers.Dense(CLASSES)(layers.GlobalAveragePooling2D()(x))
        return keras.Model(inputs, x)
    raise ValueError(f"Unknown model {name!r}. Expected one of: {', '.join(MODELS)}.")


def train(impl: str, model_name: str, batch: int, warmup: int, steps: int, optimizer: str = "sgd",
          shard: bool = False) -> Tuple[int, int, List[float]]:
    """Train ``model_name`` under ``impl`` (hvdp, horovod, mwms, single); (rank, size, seconds per measured step).

    ``optimizer`` "adam" or ``shard`` (hvdp's shard_optimizer_state) also record each rank's
    optimizer-state bytes and peak RSS (``timing.MEMORY``).
    """
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         reduction="sum_over_batch_size")
    strategy: Optional[Any] = None
    if impl == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank, size = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"]), strategy.num_replicas_in_sync
        with strategy.scope():
            model = build_model(model_name)
            opt = keras.optimizers.SGD(0.01, momentum=0.9)
            model.build((None, *_keras_shape(model_name)))
            opt.build(model.trainable_variables)
    else:
        model = build_model(model_name)
        opt = keras.optimizers.Adam(0.001) if optimizer == "adam" else keras.optimizers.SGD(0.01, momentum=0.9)
        if not shard:  # a sharded optimizer is built on its parts (built first, it is taken apart)
            opt.build(model.trainable_variables)
    reduce: Optional[Callable[[List[Any]], List[Any]]] = None
    if impl == "hvdp":
        import hvdp

        hvdp.init(framework="tensorflow")
        rank, size = hvdp.rank(), hvdp.size()
        opt = hvdp.DistributedOptimizer(opt, shard_optimizer_state=shard)
        hvdp.broadcast_state(model, opt)
    elif impl == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        for variable in model.variables:
            variable.assign(hvd.broadcast(tf.convert_to_tensor(variable), 0))

        def reduce(grads: List[Any]) -> List[Any]:
            # What horovod.tensorflow.DistributedGradientTape does (it fails on Keras 3 variables).
            return [hvd.allreduce(g, op=hvd.Average) for g in grads]
    elif impl == "single":
        rank, size = 0, 1
    elif impl != "mwms":
        raise ValueError(f"Unknown TensorFlow training implementation {impl!r}.")
    xs, ys = models.synthetic_batches(model_name, batch, timing.POOL, seed=1000 + rank)
    if len(xs.shape) == 5:
        xs = np.ascontiguousarray(xs.transpose(0, 1, 3, 4, 2))
    x, y = tf.constant(xs), tf.constant(ys)
    variables = model.trainable_variables

    if strategy is None:
        @tf.function(jit_compile=False)
        def train(features: Any, labels: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(features, training=True))
            grads = tape.gradient(loss, variables)
            if reduce is not None:
                grads = reduce(grads)
            opt.apply_gradients(zip(grads, variables))
            return loss

        def step(i: int) -> None:
            float(train(x[i % timing.POOL], y[i % timing.POOL]))
    else:
        global_batch = batch * size
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        @tf.function(jit_compile=False)
        def replica_step(features: Any, labels: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(per_example(labels, model(features, training=True))) / global_batch
            grads = tape.gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables))
            return loss

        @tf.function(jit_compile=False)
        def train_mwms(features: Any, labels: Any) -> Any:
            # This worker's own loss, as hvdp's and Horovod's steps return theirs: no reduce of the loss across
            # workers, which would be a collective more per step than the other contenders make (equal work).
            per_replica = strategy.run(replica_step, args=(features, labels))
            return strategy.experimental_local_results(per_replica)[0]

        def step(i: int) -> None:
            float(train_mwms(x[i % timing.POOL], y[i % timing.POOL]))

    times = timing.timed_steps(step, warmup, steps)
    if optimizer != "sgd" or shard:
        mine = (int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in opt.variables)),
                timing.peak_rss_bytes())
        import hvdp

        every = hvdp.allgather_object(mine) if impl == "hvdp" else [mine]
        timing.MEMORY.update({"state_bytes": [e[0] for e in every], "peak_rss_bytes": [e[1] for e in every]})
    return rank, size, times


def _keras_shape(model_name: str) -> Tuple[int, ...]:
    shape = models.INPUT_SHAPES[model_name]
    return (shape[1], shape[2], shape[0]) if len(shape) == 3 else shape
