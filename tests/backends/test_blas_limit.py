"""The CPU backend's BLAS limit (one thread while a search runs, its tiles on the backend's own threads) under
searches that overlap: the process's own limit must be back when the last one ends."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import recall


def _blas_threads() -> list[int]:
    threadpoolctl = pytest.importorskip("threadpoolctl")
    return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]


def test_overlapping_searches_leave_the_processes_blas_threads_as_they_were() -> None:
    before = _blas_threads()
    if not before or max(before) < 2:
        pytest.skip("a BLAS of one thread: nothing a search could leave lowered")
    rng = np.random.default_rng(0)
    items = rng.standard_normal((5_000, 32), dtype=np.float32)
    users = [rng.standard_normal((200, 32), dtype=np.float32) for _ in range(4)]
    engine = recall.Engine(items, device="cpu")
    want = [engine.search(u, 10).indices for u in users]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(10):
                np.testing.assert_array_equal(engine.search(users[i], 10).indices, want[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert _blas_threads() == before
