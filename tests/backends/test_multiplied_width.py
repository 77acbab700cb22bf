"""The columns a fused float16 pass multiplies (``recall.backends.cupy.fused.multiplied_width``), on host arrays: the
rule the GPU applies to device arrays in the same function."""
from __future__ import annotations

import numpy as np
import pytest

from recall.backends.cupy.fused import multiplied_width


@pytest.mark.parametrize("width,values_to,multiplied", [
    (72, 64, 64), (72, 65, 80), (72, 72, 80), (40, 32, 32), (40, 33, 48), (8, 8, 16), (136, 128, 128),
    (136, 129, 144), (24, 1, 16),
])
def test_up_to_the_last_column_held_rounded_to_16(width, values_to, multiplied):
    users = np.zeros((50, width), np.float16)
    users[:, :values_to - 1] = 1.5
    users[49, values_to - 1] = -2.0  # one user's value decides the width
    assert multiplied_width(users) == multiplied


def test_zeros_and_negative_zeros_multiply_nothing():
    users = np.zeros((10, 72), np.float16)
    assert multiplied_width(users) == 16
    users[:, 70] = -0.0
    users[:, :20] = 1
    assert multiplied_width(users) == 32
    assert multiplied_width(np.zeros((0, 72), np.float16)) == 16
