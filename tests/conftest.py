"""Shared fixtures: the backend-parametrised ``device`` fixture and seeded data.

Every Engine test takes ``device``, so the same test bodies run on the CPU backend here and on the GPU backend on a
GPU machine (``pytest -m gpu``). Without a usable GPU the "gpu" params are skipped with the probe's reason.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# A developer's own `recall tune` cache must not change the tilings the tests run with.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="recall-test-cache-")

# ``import oracle`` from test modules, whatever the rootdir/import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))

# ``deadline=None``: the first example in a process pays numba's compile or cache load, and a shared CI runner's
# timing is no test. Each property test bounds its own ``max_examples``. The device fixture is a plain string, safe
# to share across examples.
settings.register_profile(
    "recall",
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("recall")


def _gpu_status() -> tuple[bool, str]:
    from recall.backends import cuda_status

    return cuda_status()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``gpu``-marked test at collection when no GPU is usable, with the probe's reason.

    On a GPU machine nothing is skipped, and ``-m gpu`` selects exactly the GPU params of the shared bodies plus
    GPU-only tests.
    """
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    usable, reason = _gpu_status()
    if usable:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {reason}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


#: Fast precision's own passes on every backend and at any size: the CPU emulates the GPU's float16 arithmetic only
#: when asked (it searches in exact precision otherwise), and the GPU ignores it; test-sized searches are under the
#: scores a float16 pass is run for (``fast.min_scores``) unless ``float16_min_scores`` says otherwise.
def emulated(**fields: object) -> "EngineOptions":
    from recall import EngineOptions

    return EngineOptions(**{"fast_emulation": True, "float16_min_scores": 0, **fields})


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """The backend to run an Engine test on: "cpu", or "gpu" (skipped cleanly without a usable GPU)."""
    if request.param == "gpu":
        usable, reason = _gpu_status()
        if not usable:
            pytest.skip(f"no usable GPU: {reason}")
    return request.param


@pytest.fixture
def gpu_available() -> bool:
    return _gpu_status()[0]


# ---- seeded data -------------------------------------------------------------------------------------------------

def normal_data(n_users: int, n_items: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Standard normal float32 users and items."""
    rng = np.random.default_rng(seed)
    users = rng.standard_normal((n_users, dim)).astype(np.float32)
    items = rng.standard_normal((n_items, dim)).astype(np.float32)
    return users, items


def clustered_data(n_users: int, n_items: int, dim: int, n_clusters: int = 8, seed: int = 0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Users and items around a few cluster centres, item norms skewed (log-normal), as real embeddings are: many
    near-duplicates per cluster and a few high-norm items that win for many users under ``ip``."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_clusters, dim))
    item_c = rng.integers(0, n_clusters, n_items)
    user_c = rng.integers(0, n_clusters, n_users)
    items = centres[item_c] + 0.3 * rng.standard_normal((n_items, dim))
    items *= rng.lognormal(0.0, 0.75, (n_items, 1))
    users = centres[user_c] + 0.3 * rng.standard_normal((n_users, dim))
    return users.astype(np.float32), items.astype(np.float32)


def ties_data(n_users: int, n_items: int, dim: int, low: int = -2, high: int = 2, seed: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
    """Small-integer-valued float32 vectors: every score is an exact small integer in float32 and float64, so many
    items tie and the tie rule (lower item row first) decides the order. Items also contain exact duplicate rows."""
    rng = np.random.default_rng(seed)
    users = rng.integers(low, high + 1, (n_users, dim)).astype(np.float32)
    items = rng.integers(low, high + 1, (n_items, dim)).astype(np.float32)
    if n_items >= 4:
        dup = rng.choice(n_items, size=n_items // 4, replace=False)
        items[dup] = items[rng.integers(0, n_items, dup.size)]
    return users, items


def plateau_data(n_users: int, seed: int, n_items: int = 3000, plateau: int = 60, dim: int = 16
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Users near one direction v, and ``plateau`` items within a relative 3e-4 of v (their scores of a user lie
    closer together than the certificate's bound, about 2^-11 of |u|·|v|, yet about a hundred float32 steps apart),
    the other items far below: a first pass of k + m + 1 <= plateau candidates cannot be certified, one of
    k + WIDEN·m + 1 > plateau can."""
    rng = np.random.default_rng(seed)
    v = rng.normal(size=dim)
    items = 0.1 * rng.normal(size=(n_items, dim))
    near = rng.choice(n_items, plateau, replace=False)
    items[near] = v + 3e-4 * rng.normal(size=(plateau, dim))
    users = v + 0.3 * rng.normal(size=(n_users, dim))
    return users.astype(np.float32), items.astype(np.float32)


@pytest.fixture
def make_normal():
    return normal_data


@pytest.fixture
def make_clustered():
    return clustered_data


@pytest.fixture
def make_ties():
    return ties_data
