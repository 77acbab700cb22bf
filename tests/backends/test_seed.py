"""The GPU's threshold-sample size (``recall.backends.cupy.selection.seed_size``): a pure rule, checked here without a
GPU; the seeded searches themselves are checked on the device (tests/backends/test_gpu.py)."""
from __future__ import annotations

import pytest

from recall.backends.cupy.selection import seed_size


@pytest.mark.parametrize("n_items, k, capacity, want", [
    (1_000_000, 100, 32_768, 8_192),     # S1: the full sample
    (1_000_000, 2_048, 32_768, 32_768),  # large k: 32k items, capped by the score buffer
    (1_000_000, 8_192, 8_192, 0),        # the buffer cannot hold 4k sampled items
    (100_000, 100, 32_768, 8_192),       # 8 x 8,192 <= 100k: the full sample
    (100_000, 1_000, 32_768, 0),         # fewer than 8 x 32k items: no seed
    (60_000, 100, 32_768, 0),            # fewer than 8 x 8,192 items: no seed
    (100_000, 4_000, 32_768, 0),
    (20_000, 37, 900, 900),              # small tiles (the tests' plans): the buffer's width
])
def test_sample_size(n_items, k, capacity, want):
    assert seed_size(n_items, k, capacity) == want
    assert seed_size(n_items, k, capacity, seeded=False) == 0


def test_sample_fits_its_stride():
    # The sample takes every (n_items // size)-th row from the middle of the first stride: all within the items.
    for n_items, k in ((100_000, 1_000), (70_000, 1_000), (1_000_000, 100), (200_001, 4_096)):
        size = seed_size(n_items, k, 32_768)
        if size:
            stride = n_items // size
            assert stride // 2 + stride * (size - 1) < n_items and size <= n_items // 8
