"""Core API on TensorFlow/Keras 3: rank/size, broadcast_state, model.fit and a GradientTape loop
on different data per rank."""

from __future__ import annotations

import sys

import keras
import numpy as np
import tensorflow as tf

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _data
import _elementwise
import _grouped
import _report
import _scatter
from _report import refusal


def flat(variables: list) -> list:
    return np.concatenate([np.asarray(v).reshape(-1) for v in variables]).astype(float).tolist()


def make_model() -> keras.Model:
    return keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.Dense(3)])


def rank_data(rank: int, n: int) -> tuple:
    data = np.random.default_rng(100 + rank)
    return data.normal(size=(n, 8)).astype(np.float32), data.integers(0, 3, size=n)


def main() -> None:
    hvdp.init()
    rank, size = hvdp.rank(), hvdp.size()
    record = {"rank": rank, "size": size, "local_rank": hvdp.local_rank(),
              "local_size": hvdp.local_size(), "cross_rank": hvdp.cross_rank(),
              "cross_size": hvdp.cross_size(), "framework": hvdp.framework(),
              "keras_backend": keras.backend.backend()}
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = rank_data(rank, 64)

    # Different initial weights and optimizer state on every rank ...
    keras.utils.set_random_seed(rank)
    model = make_model()
    adam = keras.optimizers.Adam(0.01)
    with tf.GradientTape() as tape:
        loss = loss_fn(y[:16], model(x[:16], training=True))
    adam.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    record["before_broadcast"] = flat(model.variables)
    record["adam_before"] = flat(adam.variables)
    # ... made identical by broadcast_state.
    hvdp.broadcast_state(model, adam, root_rank=0)
    record["after_broadcast"] = flat(model.variables)
    record["params_after_broadcast"] = flat(model.trainable_variables)
    record["adam_after"] = flat(adam.variables)

    # model.fit with different data on each rank.
    fit_opt = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    record["optimizer_class"] = type(fit_opt).__name__
    model.compile(optimizer=fit_opt, loss=loss_fn)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    record["fit_losses"] = [float(v) for v in history.history["loss"]]  # the ranks' loss (the union's)
    record["fit_data"] = _report.digest(x)
    record["after_fit"] = flat(model.trainable_variables)

    # A custom loop: GradientTape + apply_gradients inside tf.function, then eagerly.
    loop_model = make_model()
    hvdp.broadcast_state(loop_model)
    loop_opt = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01))

    def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, loop_model(xb, training=True))
        grads = tape.gradient(loss, loop_model.trainable_variables)
        loop_opt.apply_gradients(zip(grads, loop_model.trainable_variables))
        return loss

    graph_step = tf.function(step)
    losses = []
    for i in range(4):
        xb, yb = tf.constant(x[16 * i:16 * (i + 1)]), tf.constant(y[16 * i:16 * (i + 1)])
        losses.append(float(graph_step(xb, yb) if i % 2 == 0 else step(xb, yb)))
    record["loop_losses"] = losses
    record["after_loop"] = flat(loop_model.trainable_variables)
    record["allreduce_tensor"] = hvdp.allreduce(tf.constant([float(rank)] * 2)).numpy().tolist()
    record["allreduce_number"] = hvdp.allreduce(rank + 1.0)
    record["elementwise"] = _elementwise.check(tf.constant, lambda t: t.numpy())
    record["scatter"] = _scatter.check(tf.constant, lambda t: t.numpy())
    record["grouped"] = _grouped.check(tf.constant, lambda t: t.numpy())
    record["data"] = {"sampler": _data.sampler(), "dataset": _data.tf_dataset()}
    record["elementwise_refusals"] = {
        "optimizer": refusal(lambda: hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1), op="product")),
        "tape": refusal(lambda: hvdp.DistributedGradientTape(tf.GradientTape(), op="max")),
    }
    _report.write(rank, record)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
