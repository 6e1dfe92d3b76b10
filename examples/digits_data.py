"""The data every example trains on: scikit-learn's bundled 8x8 digits (1797 images, no download)."""

from __future__ import annotations

from typing import Tuple

import numpy as np

Arrays = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def load_digits(seed: int) -> Arrays:
    """Stratified 80/20 split of the digits, standardized with training statistics.

    Returns:
        x_train, y_train, x_test, y_test (float32 features, int64 labels).
    """
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    data = sklearn_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data.astype(np.float32), data.target.astype(np.int64),
        test_size=0.2, random_state=seed, stratify=data.target)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1e-6
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test
