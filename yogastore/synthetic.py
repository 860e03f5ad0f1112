"""A built-in synthetic image-classification dataset (numpy, deterministic)."""

from __future__ import annotations

import numpy as np

__all__ = ["synthetic_images"]


def synthetic_images(
    num_records: int,
    image_shape: tuple[int, int, int] = (32, 32, 3),
    num_classes: int = 10,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Return ``{"image", "label", "id"}`` arrays of a learnable toy problem.

    Each class has its own mean colour; images are that colour plus noise, so a
    small model can learn the labels. ``id`` is the record's index.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=num_records).astype(np.int64)
    centers = rng.integers(40, 216, size=(num_classes, 1, 1, image_shape[2]))
    noise = rng.integers(-40, 40, size=(num_records, *image_shape))
    images = np.clip(centers[labels] + noise, 0, 255).astype(np.uint8)
    return {"image": images, "label": labels, "id": np.arange(num_records, dtype=np.int64)}
