"""The columns a fused float16 pass multiplies (``recall.backends.cupy.fused.multiplied_width``): the rule on host
arrays, and the GPU's count of device arrays (``recall_last_column``) against it."""
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


@pytest.mark.gpu
@pytest.mark.parametrize("n, width", [(1, 8), (50, 72), (5000, 40), (100_003, 80), (3, 136)])
def test_the_gpus_count_is_the_rule(n, width):
    # Each row's last used column drawn below `last`, the deciding one in the last row (the grid-stride loop's far
    # end), -0 beyond it and some all-zero rows: the device's count against the host rule, for each `last`.
    import cupy

    from recall.backends.cupy.fused import count_multiplied

    rng = np.random.default_rng(n + width)
    for last in sorted({1, 2, width // 2, width - 1, width}):
        users = np.zeros((n, width), np.float16)
        used = rng.integers(0, last, n)
        users[np.arange(n), used] = rng.choice([-1.0, 6.0e-8, 2.0], n)  # 6e-8: float16's least subnormal, not 0
        users[:, last:] = -0.0
        users[rng.integers(0, n, max(1, n // 10))] = 0.0
        users[n - 1, last - 1] = -0.5
        want = multiplied_width(users)
        assert count_multiplied(cupy.asarray(users))() == want == max(16, -(-last // 16) * 16)
    assert count_multiplied(cupy.zeros((n, width), cupy.float16))() == 16
    assert count_multiplied(cupy.asarray(np.full((n, width), -0.0, np.float16)))() == 16


def test_the_widest_rows_a_float16_kernel_takes():
    from recall import EngineOptions
    from recall.backends.cupy.fused import FUSED_H_MAX_WIDTH, FUSED_W_MAX_WIDTH, covers, half_max_width

    assert (FUSED_H_MAX_WIDTH, FUSED_W_MAX_WIDTH) == (128, 144)
    assert half_max_width(True, EngineOptions()) == 144  # Hopper's wgmma kernels, built
    assert half_max_width(True, EngineOptions(warpgroup_mma=False)) == 128
    assert half_max_width(False, EngineOptions()) == 128  # other GPUs, or an NVRTC that could not build them
    assert covers(144, np.float16, 144) and not covers(152, np.float16, 144) and not covers(136, np.float16)
    assert covers(128, np.float16) and not covers(140, np.float16, 144)  # whole 16-byte pieces only
    assert covers(256, np.float32, 128) and not covers(264, np.float32, 144)  # float32: fused.cu's own limit
