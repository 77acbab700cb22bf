"""Large host arrays to the GPU and back through pinned chunks (``backends.cupy.transfers``): the same values as
one copy, any layout and dtype, every chunk and the tail, ordered after the work queued before them; and a search of
host users through them (the certified route uploads its users whole) equal to the same search of device users.
Chunks are made small so that small arrays cross in many."""
from __future__ import annotations

import numpy as np
import pytest

from recall import Engine, EngineOptions
from recall.backends import cuda_status

usable, reason = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not usable, reason=f"no usable GPU: {reason}")]


@pytest.fixture
def small_chunks(monkeypatch):
    from recall.backends.cupy import transfers

    monkeypatch.setattr(transfers, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(transfers, "MIN_BYTES", 1)
    return transfers


@pytest.fixture
def backend():
    return Engine(np.eye(4, dtype=np.float32), device="gpu").backend


@pytest.mark.parametrize("layout", ["C", "strided", "float64", "F", "wide-rows", "one-row", "no-rows"])
def test_upload_equals_the_host_array(small_chunks, backend, layout):
    import cupy

    rng = np.random.default_rng(3)
    base = rng.standard_normal((1000, 40))
    host = {"C": base.astype(np.float32), "strided": base.astype(np.float32)[::3, ::2], "float64": base,
            "F": np.asfortranarray(base.astype(np.float32)), "wide-rows": rng.standard_normal((7, 3000)),
            "one-row": base[:1].astype(np.float32), "no-rows": base[:0].astype(np.float32)}[layout]
    calls = []
    real = backend.transfers.upload
    backend.transfers.upload = lambda *a: calls.append(1) or real(*a)
    try:
        got = backend.ingest(host)
    finally:
        del backend.transfers.upload
    assert calls or host.nbytes == 0
    assert got.dtype == cupy.float32 and got.flags.c_contiguous and got.shape == host.shape
    np.testing.assert_array_equal(cupy.asnumpy(got), host.astype(np.float32))
    # Ordered before later work on the caller's stream: a reduction queued at once sees every chunk.
    assert float(got.astype(cupy.float64).sum()) == pytest.approx(float(host.astype(np.float32).sum(dtype=np.float64)))


@pytest.mark.parametrize("what", ["float32", "int64", "transposed", "int8", "no-rows"])
def test_download_equals_the_device_array(small_chunks, backend, what):
    import cupy

    rng = np.random.default_rng(4)
    dev = {"float32": cupy.asarray(rng.standard_normal((999, 13), dtype=np.float32)),
           "int64": cupy.asarray(rng.integers(-2**62, 2**62, size=(500, 11))),
           "transposed": cupy.asarray(rng.standard_normal((30, 700), dtype=np.float32)).T,
           "int8": cupy.asarray(rng.integers(-100, 100, size=(5000, 3), dtype=np.int8)),
           "no-rows": cupy.zeros((0, 5), np.float32)}[what]
    want = cupy.asnumpy(dev)
    # Queued on the compute stream just before: the download waits for it.
    with backend.compute_stream:
        dev += dev.dtype.type(1)
    got = backend.to_host(dev)
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want + want.dtype.type(1))


def test_large_arrays_take_the_chunks_unpatched(backend):
    """At the shipped sizes: an array past MIN_BYTES (up in several chunks of the ring, down in one page-locked
    copy) comes back equal."""
    from recall.backends.cupy import transfers

    n = transfers.MIN_BYTES // (4 * 64) + 777
    host = np.random.default_rng(5).standard_normal((n, 64), dtype=np.float32)
    dev = backend.ingest(host)
    back = backend.to_host(dev)
    np.testing.assert_array_equal(back, host)


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_host_users_through_the_chunks_equal_device_users(small_chunks, metric):
    """The certified route uploads host users whole and fetches the results whole: both through the chunks here,
    the answer bit for bit that of the same users on the device."""
    import cupy

    rng = np.random.default_rng(6)
    items = rng.standard_normal((20_000, 24), dtype=np.float32)
    users = rng.standard_normal((3000, 24), dtype=np.float32)
    engine = Engine(items, metric=metric, device="gpu", options=EngineOptions(certified_exact="on"))
    on_device = engine.search(cupy.asarray(users), 10)
    assert engine.stats.get("route") == "certified"
    on_host = engine.search(users, 10)
    assert engine.stats.get("route") == "certified"
    assert isinstance(on_host.indices, np.ndarray)
    np.testing.assert_array_equal(on_host.indices, cupy.asnumpy(on_device.indices))
    np.testing.assert_array_equal(on_host.scores, cupy.asnumpy(on_device.scores))


def test_download_without_page_locked_memory_falls_back(small_chunks, backend, monkeypatch):
    """Where no page-locked array of the result's size can be had, the driver's own copy: the same values."""
    import cupy
    import cupyx

    def refuse(*args, **kwargs):
        raise cupy.cuda.memory.OutOfMemoryError(1 << 40, 0)

    dev = cupy.arange(6000, dtype=cupy.int64).reshape(1000, 6)
    monkeypatch.setattr(cupyx, "empty_pinned", refuse)
    got = backend.to_host(dev)
    np.testing.assert_array_equal(got, np.arange(6000).reshape(1000, 6))
