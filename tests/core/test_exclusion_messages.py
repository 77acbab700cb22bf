"""Exclusion messages name an item row as the caller gave it: a uint64 row beyond the int64 range is not "-1"."""
from __future__ import annotations

import numpy as np
import pytest

from recall import Engine, InputError
from recall.core.exclusions import normalise

BIG = 2 ** 64 - 1


@pytest.mark.parametrize("exclude, needle", [
    ((np.array([0, 1, 1, 1]), np.array([BIG], np.uint64)), rf"item row {BIG} \(user row 0\)"),
    ((np.array([0, 1, 1, 3]), np.array([2, 1, BIG - 1], np.uint64)), rf"item row {BIG - 1} \(user row 2\)"),
    ({0: np.array([BIG], np.uint64)}, rf"item row {BIG} \(user row 0\)"),
    ({0: [1], 1: [], 2: np.array([3, BIG], np.uint64)}, rf"item row {BIG} \(user row 2\)"),
    ({0: [1], 2: [BIG]}, rf"item row {BIG} \(user row 2\)"),
    ({1: [3, -1]}, r"item row -1 \(user row 1\)"),
    ({0: [2], 1: (r for r in [0, 7])}, r"item row 7 \(user row 1\)"),
])
def test_item_row_is_named_as_given(exclude, needle):
    with pytest.raises(InputError, match=rf"^exclude: {needle} is out of range for 4 items$"):
        normalise(exclude, 3, 4)


def test_engine_names_a_uint64_row_as_given(device):
    engine = Engine(np.eye(4, dtype=np.float32), device=device)
    exclude = (np.array([0, 1]), np.array([BIG], np.uint64))
    with pytest.raises(InputError, match=rf"^exclude: item row {BIG} \(user row 0\) is out of range for 4 items$"):
        engine.search(np.ones((1, 4), np.float32), 2, exclude=exclude)
