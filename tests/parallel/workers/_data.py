"""hvdp.DistributedSampler (iterated, and in a torch DataLoader) and hvdp.shard_dataset (tf.data): which
examples each rank takes, reported for the test to check against every rank's and a reference."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
from _report import refusal

import hvdp

#: Examples dealt: one left over on 2 ranks, so padding and dropping both show.
N = 11


def digits(count: int = N) -> np.ndarray:
    """The first ``count`` images of scikit-learn's digits, as float32 rows."""
    from sklearn.datasets import load_digits

    return load_digits().data[:count].astype(np.float32)


def sampler() -> Dict[str, Any]:
    found: Dict[str, Any] = {}
    for drop in (False, True):
        sampler = hvdp.DistributedSampler(N, seed=5, drop_last=drop)
        epochs = []
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            epochs.append(list(sampler))
        found[f"drop_last_{drop}"] = {"epochs": epochs, "len": len(sampler), "repeated": sampler.repeated,
                                      "left_out": sampler.left_out}
    found["in_order"] = list(hvdp.DistributedSampler(list(range(N)), shuffle=False))
    found["in_order_drop_last"] = list(hvdp.DistributedSampler(N, shuffle=False, drop_last=True))
    plain = hvdp.DistributedSampler(N)
    found["refusals"] = {"no_len": refusal(lambda: hvdp.DistributedSampler(iter(range(3)))),
                         "seed": refusal(lambda: hvdp.DistributedSampler(N, seed=-1)),
                         "empty": refusal(lambda: hvdp.DistributedSampler(0)),
                         "epoch": refusal(lambda: plain.set_epoch("1"))}
    return found


def torch_loader() -> Dict[str, Any]:
    """A DataLoader over digits with hvdp's sampler: the rows each epoch brings, and DDP's sampler's indices."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data import DistributedSampler as DDPSampler

    x = torch.from_numpy(digits())
    dataset = TensorDataset(x, torch.arange(N))
    sampler = hvdp.DistributedSampler(dataset, seed=5)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    epochs = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        rows, ids = [], []
        for xb, ib in loader:
            rows.append(xb)
            ids += ib.tolist()
        rows_match = bool(torch.equal(torch.cat(rows), x[ids]))
        epochs.append({"ids": ids, "rows_match_ids": rows_match, "batches": len(rows)})
    ddp = {f"drop_last_{drop}": list(DDPSampler(dataset, num_replicas=hvdp.size(), rank=hvdp.rank(),
                                                shuffle=False, drop_last=drop)) for drop in (False, True)}
    return {"epochs": epochs, "sampler_indices": [sampler.indices().tolist()], "ddp_in_order": ddp,
            "loader_len": len(loader)}


def tf_dataset() -> Dict[str, Any]:
    """Called while the global seed is the rank (the worker's keras.utils.set_random_seed(rank))."""
    import keras
    import tensorflow as tf

    def shuffled() -> Any:
        return tf.data.Dataset.range(N).shuffle(N, seed=3).batch(2)

    refused = {"rank_seeds": refusal(lambda: hvdp.shard_dataset(shuffled()))}
    tf.random.set_seed(None)
    refused["unseeded"] = refusal(lambda: hvdp.shard_dataset(tf.data.Dataset.range(N).shuffle(N).batch(2)))
    keras.utils.set_random_seed(123)  # the same on every rank

    def ints(ds: Any) -> list:
        return [int(v) for v in ds]

    def batches(ds: Any) -> list:
        return [[int(v) for v in batch] for batch in ds]

    fixed = tf.data.Dataset.range(N).shuffle(N, seed=3, reshuffle_each_iteration=False)
    found: Dict[str, Any] = {
        "range": ints(hvdp.shard_dataset(tf.data.Dataset.range(N))),
        "range_drop": ints(hvdp.shard_dataset(tf.data.Dataset.range(N), drop_remainder=True)),
        "order": ints(fixed),  # the seeded order every rank's pipeline produces
        "shuffled": ints(hvdp.shard_dataset(fixed)),
        "before_batch": batches(hvdp.shard_dataset(fixed).batch(2)),
        "after_batch_repeat": batches(hvdp.shard_dataset(fixed.batch(2).repeat(2))),
        "after_batch_drop": batches(hvdp.shard_dataset(fixed.batch(3, drop_remainder=True))),
    }
    pairs = tf.data.Dataset.from_tensor_slices((digits(), np.arange(N)))
    mine = list(hvdp.shard_dataset(pairs))
    found["pairs_ids"] = [int(i) for _, i in mine]
    found["pairs_rows_match"] = bool(all(np.array_equal(x.numpy(), digits()[int(i)]) for x, i in mine))
    found["refusals"] = {
        **refused,
        "padded": refusal(lambda: hvdp.shard_dataset(tf.data.Dataset.range(N).padded_batch(2))),
        "not_a_dataset": refusal(lambda: hvdp.shard_dataset(list(range(N)))),
    }
    return found
