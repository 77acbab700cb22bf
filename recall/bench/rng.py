"""Seeded random streams on NumPy or CuPy (data generated where it is used: a 1M x 256 matrix never crosses PCIe)."""
from __future__ import annotations

from typing import Any

import numpy as np

from recall import InputError


class Rng:
    """One seeded float32 random stream over NumPy or CuPy, with the few draws the generators need."""

    def __init__(self, xp: Any, seed: int) -> None:
        self.xp = xp
        if xp is np:
            self._rng = np.random.default_rng(seed)
        else:
            # CuPy's legacy RandomState draws float32 normals natively (no float64 detour) on every CuPy version.
            self._rng = xp.random.RandomState(seed)

    def normal(self, shape: tuple[int, ...]) -> Any:
        return self._rng.standard_normal(shape, dtype=self.xp.float32)

    def integers(self, low: int, high: int, shape: tuple[int, ...], dtype: Any = np.int64) -> Any:
        """Integers in [low, high)."""
        if self.xp is np:
            return self._rng.integers(low, high, size=shape, dtype=dtype)
        return self._rng.randint(low, high, size=shape, dtype=dtype)

    def lognormal(self, sigma: float, n: int) -> Any:
        if self.xp is np:
            return self._rng.lognormal(0.0, sigma, size=n).astype(np.float32)
        return self._rng.lognormal(0.0, sigma, size=n, dtype=self.xp.float32)

    def uniform(self, n: int) -> Any:
        """float32 in [0, 1)."""
        if self.xp is np:
            return self._rng.random(n, dtype=np.float32)
        return self._rng.random_sample(size=n, dtype=self.xp.float32)


def module_for(device: str) -> Any:
    if device == "cpu":
        return np
    if device == "gpu":
        try:
            import cupy
        except ImportError as exc:
            raise InputError(f"device='gpu' needs CuPy to generate data on the GPU: {exc}") from None
        return cupy
    raise InputError(f"unknown device {device!r}: expected 'cpu' or 'gpu'")


def candidate_rows(n_users: int, n_items: int, per_user: int, seed: int = 0, device: str = "cpu") -> Any:
    """(n_users, per_user) int64 item rows, distinct within each row, spread over the catalogue, in random order.

    Distinct (like the output of a retriever stage) so that baselines without de-duplication stay comparable: a
    random start plus increasing gaps of at most ``n_items // per_user`` never wraps onto itself.

    Raises
    ------
    InputError
        If ``per_user`` > ``n_items``.
    """
    if per_user > n_items:
        raise InputError(f"{per_user} candidates per user need at least as many items, got {n_items}")
    xp = module_for(device)
    rng = Rng(xp, int(np.random.SeedSequence([int(seed), 0x5C0E]).generate_state(1)[0]))
    gap = max(1, n_items // per_user)
    steps = rng.integers(1, gap + 1, (n_users, per_user))
    offsets = xp.cumsum(steps, axis=1) - steps[:, :1]  # 0, then strictly increasing, below n_items
    rows = (rng.integers(0, n_items, (n_users, 1)) + offsets) % n_items
    order = xp.argsort(rng.normal((n_users, per_user)), axis=1)
    return xp.ascontiguousarray(xp.take_along_axis(rows, order, axis=1).astype(xp.int64))
