"""The backend seam: ``resolve`` and the CUDA probe, and the protocol primitives every backend implements (checked
through the ``device`` fixture, so a new backend inherits these tests)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

import oracle
from oracle import as_numpy
from recall import BackendUnavailable, EngineOptions, InputError, backends
from recall.backends.numpy import NumpyBackend, heap
from recall.backends import cuda_status


@pytest.fixture
def backend(device):
    return backends.resolve(device)


# ---- resolution and the probe ------------------------------------------------------------------------------------

def test_cuda_status_is_a_reason_and_cached():
    usable, reason = cuda_status()
    assert isinstance(usable, bool)
    assert isinstance(reason, str) and reason and "\n" not in reason
    assert cuda_status() is cuda_status()


def test_resolve_cpu():
    b = backends.resolve("cpu")
    assert isinstance(b, NumpyBackend)
    assert b.name == "cpu" and b.xp is np


@pytest.mark.parametrize("bad", ["GPU", "cuda", "", None, "cpu:0"])
def test_resolve_unknown_device(bad):
    with pytest.raises(InputError, match="expected one of auto, cpu, gpu"):
        backends.resolve(bad)


def test_resolve_gpu_without_gpu(gpu_available):
    if gpu_available:
        pytest.skip("a usable GPU is present")
    with pytest.raises(BackendUnavailable, match="no GPU is usable") as info:
        backends.resolve("gpu")
    assert cuda_status()[1] in str(info.value)


def test_auto_falls_back_and_says_so_once(gpu_available, monkeypatch, caplog):
    if gpu_available:
        pytest.skip("a usable GPU is present: auto picks it")
    monkeypatch.setattr(backends, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="recall"):
        first = backends.resolve("auto")
        second = backends.resolve("auto")
    assert first.name == second.name == "cpu"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "CPU" in r.getMessage()]
    assert len(warnings) == 1
    assert cuda_status()[1] in warnings[0].getMessage()


def test_auto_picks_the_gpu_when_usable(gpu_available):
    if not gpu_available:
        pytest.skip(f"no usable GPU: {cuda_status()[1]}")
    assert backends.resolve("auto").name == "gpu"


# ---- protocol primitives, on every backend ------------------------------------------------------------------------

def test_describe_and_budgets(backend):
    assert isinstance(backend.describe(), str) and backend.describe()
    assert backend.free_memory() > 0
    budget = backend.default_budget()
    assert 0 < budget <= max(backend.free_memory(), 1)
    assert backend.state_bytes(1) > 0
    assert backend.state_bytes(100) > backend.state_bytes(10)
    tiles = backend.preferred_tiles(64, 100, np.float32, 10_000, 100_000, EngineOptions())
    assert len(tiles) == 3 and all(isinstance(t, int) and t >= 1 for t in tiles)


@pytest.mark.parametrize("workers, n_users, dim, k, want", [
    (2, 5_000, 64, 100, 834),  # 6 blocks, 3 a core (not 5 of 1,024: 3 on one core, 2 on the other)
    (2, 2_000, 768, 100, 1_000),  # wide vectors keep large blocks (the rule before: 128 users at d = 768)
    (2, 20_000, 64, 100, 1_000),
    (4, 20_000, 64, 100, 1_000),  # 20 blocks, 5 a core
    (2, 900, 64, 100, 1_024),  # one block's worth: the tiling plan shares it out
    (2, 5_000, 64, 200, 500),  # heaps of 1 MiB a block at most, then the same share-out (10 blocks)
    (2, 500, 256, 2_048, 250),  # large k: buffers, blocks of about 256 users (2 of 250, not 4 of 128)
    (2, 20_000, 64, 1_000, 250),
    (2, 200, 64, 8_192, 256),
    (16, 257, 64, 1_000, 256),  # 16 even blocks would hold 17 users: the plan shares the users out instead
    (16, 2_600, 64, 100, 163),
])
def test_cpu_user_blocks_are_even_and_as_many_on_every_core(workers, n_users, dim, k, want):
    backend = NumpyBackend()
    backend.workers = workers
    users, items, per_call = backend.preferred_tiles(dim, k, np.float32, n_users, 100_000, EngineOptions())
    assert users == want and per_call == 1
    assert items == (2048 if k >= heap.BUFFER_MIN_K else max(512, (1 << 18) // users))
    if n_users > users and n_users >= 128 * workers:  # blocks of at least 128 users, as many on every core
        assert -(-n_users // users) % workers == 0


@pytest.mark.parametrize("n_users, n_items, dim, dtype, k, fused, want", [
    (100_000, 1_000_000, 64, np.float32, 100, "auto", 32768),  # seeded: the fused kernel
    (100_000, 1_000_000, 64, np.float32, 100, "off", 4096),
    (100_000, 1_000_000, 256, np.float32, 100, "auto", 32768),
    (100_000, 1_000_000, 264, np.float32, 100, "auto", 4096),  # wider than the float32 kernel takes
    (200_000, 20_000, 64, np.float32, 100, "auto", 32768),  # a small catalogue, seeded
    (33_000, 30_000, 16, np.float32, 20, "auto", 32768),  # k small for a small catalogue: seeded from 1,024 items
    (33_000, 8_000, 16, np.float32, 10, "auto", 32768),  # under 8,192 items: seeded from 512 of them
    (33_000, 1_000, 16, np.float32, 1, "auto", 4096),  # unseeded (an eighth of it is under 128): cuBLAS
    (1_000_000, 4_096, 64, np.float16, 10, "auto", 65536),  # at most 4,096 items: buffers of 4,096 keys, larger blocks
    (300_000, 2_048, 32, np.float32, 20, "auto", 65536),
    (1_000_000, 4_097, 64, np.float16, 10, "auto", 32768),
    (100_000, 1_000_000, 128, np.float16, 100, "auto", 32768),
    (100_000, 1_000_000, 264, np.float16, 100, "auto", 4096),  # fast mode's d = 256: cuBLAS
    (100, 1_000_000, 64, np.float32, 100, "auto", 4096),  # fewer users than a kernel's tile
])
def test_gpu_blocks_grow_only_where_the_pass_is_fused(n_users, n_items, dim, dtype, k, fused, want):
    # The rule needs no GPU: a fused pass shares each block's launches over 32,768 users (65,536 over at most 4,096
    # items; before the budget); the cuBLAS path, whose score tiles grow with the block, keeps 4,096 (measured slower
    # with more: docs/benchmarks.md).
    from types import SimpleNamespace

    from recall.backends.cupy import backend as gpu

    stub = SimpleNamespace(selection=SimpleNamespace(fused_w=True))
    stub.fused_applies = lambda *args: gpu.CupyBackend.fused_applies(stub, *args)  # type: ignore[arg-type]
    options = EngineOptions(fused=fused)
    users, width, tiles = gpu.CupyBackend.preferred_tiles(stub, dim, k, dtype, n_users, n_items,  # type: ignore
                                                          options)
    assert (users, tiles) == (want, 4) and width == (16384 if dim >= 128 else 8192)
    assert (gpu.FUSED_USER_BLOCK, gpu.FUSED_SMALL_USER_BLOCK, gpu.FUSED_SMALL_ITEMS, gpu.USER_BLOCK) == \
        (32768, 65536, 4096, 4096)


def test_asarray_dtypes_and_host_round_trip(backend):
    f = backend.asarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    i = backend.asarray(np.arange(4, dtype=np.int32))
    assert f.dtype == backend.xp.float32 and i.dtype == backend.xp.int64
    assert f.flags.c_contiguous
    host = backend.to_host(f)
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(backend.to_host(backend.asarray(np.asfortranarray(np.eye(3)))), np.eye(3))


@pytest.mark.parametrize("n_users, width, n_tiles, dim", [(1, 1, 1, 1), (5, 7, 3, 4), (33, 17, 2, 9), (2, 64, 5, 1)])
def test_gemm_strided_batched_shared_users(backend, n_users, width, n_tiles, dim):
    # One user block against a batch of item tiles (users stride 0), non-square, non-multiple-of-anything shapes.
    rng = np.random.default_rng(n_users * 100 + width)
    users = rng.integers(-4, 5, (1, n_users, dim)).astype(np.float32)
    items = rng.integers(-4, 5, (n_tiles, width, dim)).astype(np.float32)
    out = backend.asarray(np.full((n_tiles, n_users, width), np.nan, np.float32))
    backend.gemm_strided_batched(backend.asarray(users), backend.asarray(items), out)
    backend.synchronize()
    want = np.einsum("ud,bwd->buw", users[0].astype(np.float64), items.astype(np.float64))
    np.testing.assert_array_equal(as_numpy(out), want.astype(np.float32))


def test_gemm_strided_batched_per_tile_users(backend):
    rng = np.random.default_rng(7)
    users = rng.integers(-4, 5, (3, 6, 5)).astype(np.float32)
    items = rng.integers(-4, 5, (3, 11, 5)).astype(np.float32)
    out = backend.asarray(np.zeros((3, 6, 11), np.float32))
    backend.gemm_strided_batched(backend.asarray(users), backend.asarray(items), out)
    backend.synchronize()
    want = np.einsum("bud,bwd->buw", users.astype(np.float64), items.astype(np.float64))
    np.testing.assert_array_equal(as_numpy(out), want.astype(np.float32))


def test_gemm_into_a_prefix_view_of_a_workspace(backend):
    # The engine scores into a prefix of one flat buffer, reshaped per call: the GEMM must write exactly there.
    rng = np.random.default_rng(8)
    users = rng.integers(-3, 4, (1, 4, 3)).astype(np.float32)
    items = rng.integers(-3, 4, (2, 5, 3)).astype(np.float32)
    buf = backend.asarray(np.full(100, 123.0, np.float32))
    out = buf[: 2 * 4 * 5].reshape(2, 4, 5)
    backend.gemm_strided_batched(backend.asarray(users), backend.asarray(items), out)
    backend.synchronize()
    host = as_numpy(buf)
    want = np.einsum("ud,bwd->buw", users[0], items).astype(np.float32)
    np.testing.assert_array_equal(host[:40].reshape(2, 4, 5), want)
    np.testing.assert_array_equal(host[40:], 123.0)


def _feed(backend, state, full, width, n_items, excl=None):
    """Feed (n_users, n_cols) scores to topk_update one tile of ``width`` per call, in item order."""
    n_users, n_cols = full.shape
    indptr, rows = excl if excl is not None else (np.zeros(n_users + 1, np.int64), np.zeros(0, np.int64))
    for start in range(0, n_cols, width):
        tile = np.full((1, n_users, width), 1e30, np.float32)
        chunk = full[:, start:start + width]
        tile[0, :, : chunk.shape[1]] = chunk
        backend.topk_update(state, backend.asarray(tile), start, n_items, backend.asarray(indptr),
                            backend.asarray(rows))


def test_topk_state_life_cycle(backend):
    rng = np.random.default_rng(9)
    k = 6
    state = backend.topk_new(8, k)
    # A fresh state is empty: all padding.
    vals, rows = backend.topk_result(state)
    assert as_numpy(rows).shape == (8, k)
    np.testing.assert_array_equal(as_numpy(rows), -1)
    assert np.all(np.isneginf(as_numpy(vals)))
    # Block 1: 8 users, ties, an exclusion, and a cutoff inside the last tile (rows >= 45 hold 1e30).
    full = rng.integers(-2, 3, (8, 50)).astype(np.float32)
    excl = (np.array([0, 3, 3, 3, 3, 3, 3, 3, 48]), np.concatenate([[0, 1, 2], np.arange(45)]))
    _feed(backend, state, full, 16, 45, excl)
    vals, rows = backend.topk_result(state)
    want_idx, want_val = oracle.topk_from_scores(full[:, :45], k, excl)
    np.testing.assert_array_equal(as_numpy(rows), want_idx)
    np.testing.assert_array_equal(as_numpy(vals), want_val.astype(np.float32))
    assert as_numpy(vals).dtype == np.float32 and as_numpy(rows).dtype == np.int64
    # Block 2 reuses the state for fewer users: nothing of block 1 may survive the reset.
    backend.topk_reset(state, 3)
    full2 = np.full((3, 4), -1.0, np.float32)
    _feed(backend, state, full2, 3, 4)
    vals, rows = backend.topk_result(state)
    assert as_numpy(rows).shape == (3, k)
    np.testing.assert_array_equal(as_numpy(rows), [[0, 1, 2, 3, -1, -1]] * 3)
    np.testing.assert_array_equal(as_numpy(vals)[:, :4], -1.0)


def test_topk_update_multi_tile_batch(backend):
    rng = np.random.default_rng(10)
    n_users, width, n_tiles, k, n_items = 4, 8, 3, 5, 21
    full = rng.standard_normal((n_users, width * n_tiles)).astype(np.float32)
    full[:, n_items:] = 1e30
    batch = np.ascontiguousarray(full.reshape(n_users, n_tiles, width).transpose(1, 0, 2))
    state = backend.topk_new(n_users, k)
    empty = (np.zeros(n_users + 1, np.int64), np.zeros(0, np.int64))
    backend.topk_update(state, backend.asarray(batch), 0, n_items, *(backend.asarray(a) for a in empty))
    vals, rows = backend.topk_result(state)
    want_idx, want_val = oracle.topk_from_scores(full[:, :n_items], k)
    np.testing.assert_array_equal(as_numpy(rows), want_idx)
    np.testing.assert_array_equal(as_numpy(vals), want_val.astype(np.float32))


def _split_engine():
    """3 users, one block, against 3,000 items in tiles of 256 on 2 workers: 2 item ranges, one task each."""
    from recall import Engine, EngineOptions

    rng = np.random.default_rng(3)
    items, users = rng.standard_normal((3000, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)
    engine = Engine(items, device="cpu", options=EngineOptions(tiles=(64, 256, 1)))
    engine.backend.workers = 2  # this engine's own backend
    return engine, users


def _search_in_child(conn, engine, users) -> None:
    # In a forked child, with the parent's engine: its pool has no threads here; the backend must make its own.
    res = engine.search(users, 5)
    conn.send((engine.stats["item_parts"], res.indices.tolist()))


def test_cpu_thread_pool_is_kept_and_remade_after_a_fork():
    import multiprocessing

    engine, users = _split_engine()
    assert engine.backend.executor() is engine.backend.executor()  # kept between searches
    want = engine.search(users, 5)
    assert engine.stats["item_parts"] == 2  # the parent's pool exists and has run tasks
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_search_in_child, args=(child, engine, users))  # forked: nothing is pickled
    proc.start()
    assert parent.poll(60), "the forked child's search did not finish"
    parts, rows = parent.recv()
    proc.join(10)
    assert proc.exitcode == 0 and parts == 2 and rows == want.indices.tolist()


# ---- candidate lists of one length, the users' largest norm ----------------------------------------------------------

def _best_distinct(users: np.ndarray, items: np.ndarray, rows: np.ndarray, width: int, k: int):
    """float64 oracle of ``rescore``: each user's best k distinct rows of its list by (score desc, row asc)."""
    vals = np.full((len(users), k), -np.inf)
    got = np.full((len(users), k), -1)
    for u, user in enumerate(users.astype(np.float64)):
        mine = np.unique(rows[u * width:(u + 1) * width])
        scores = items[mine].astype(np.float64) @ user
        order = np.lexsort((mine, -scores))[:k]
        vals[u, :order.size], got[u, :order.size] = scores[order], mine[order]
    return vals, got


@pytest.mark.parametrize("rescore_path", ["fused", "gemm"])
@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("width, k", [(1, 1), (7, 3), (5, 9), (40, 40), (300, 17)])
def test_rescore_lists_of_one_length_given_as_an_int(backend, rescore_path, ordered, width, k):
    # The certified route gives every list's length (an int) rather than offsets, its rows on the device as its pass
    # left them: the same answer as the offsets give, and the oracle's (integer data: exact float32 sums).
    rng = np.random.default_rng(width * 31 + k)
    users = rng.integers(-3, 4, (9, 6)).astype(np.float32)
    items = rng.integers(-3, 4, (50, 6)).astype(np.float32)
    rows = rng.integers(0, 50, 9 * width)  # duplicates within a list count once
    store = backend.load_items(backend.ingest(items))
    opts = EngineOptions(rescore=rescore_path)
    by_int = backend.rescore(backend.ingest(users), store, width, backend.asarray(rows), k, 1 << 30, opts, ordered)
    offsets = np.arange(10, dtype=np.int64) * width
    by_csr = backend.rescore(backend.ingest(users), store, offsets, backend.asarray(rows), k, 1 << 30, opts, ordered)
    host_rows = backend.rescore(backend.ingest(users), store, width, rows, k, 1 << 30, opts, ordered)
    assert by_int[2] == by_csr[2] == host_rows[2]
    want_vals, want_rows = _best_distinct(users, items, rows, width, k)
    for vals, got, _ in (by_int, by_csr, host_rows):
        np.testing.assert_array_equal(as_numpy(got), want_rows)
        np.testing.assert_array_equal(as_numpy(vals), want_vals.astype(np.float32))


def test_rescore_no_users_given_a_length(backend):
    store = backend.load_items(backend.ingest(np.ones((4, 3), np.float32)))
    vals, rows, _ = backend.rescore(backend.ingest(np.zeros((0, 3), np.float32)), store, 5,
                                    backend.asarray(np.zeros(0, np.int64)), 2, 1 << 20, EngineOptions())
    assert vals.shape == rows.shape == (0, 2)


@pytest.mark.parametrize("n, dim", [(1, 1), (3, 5), (257, 64), (70_001, 3)])
def test_largest_norm_is_the_largest_row_norm(backend, n, dim):
    rng = np.random.default_rng(n)
    vecs = (rng.standard_normal((n, dim)) * np.exp(rng.normal(0, 3, (n, 1)))).astype(np.float32)
    want = float(np.sqrt((vecs.astype(np.float64) ** 2).sum(axis=1)).max())
    got = backend.largest_norm(backend.ingest(vecs))
    assert got == pytest.approx(want, rel=2.0 ** -45)
    # A row view (every other column: not unit stride) and host rows on any backend.
    assert backend.largest_norm(backend.ingest(vecs)[:, ::2]) == pytest.approx(
        float(np.sqrt((vecs[:, ::2].astype(np.float64) ** 2).sum(axis=1)).max()), rel=2.0 ** -45)
    assert backend.largest_norm(vecs) == pytest.approx(want, rel=2.0 ** -45)


@pytest.mark.parametrize("bad, want", [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "inf"), (3e38, "finite")])
@pytest.mark.parametrize("row", [0, 5, 999])
def test_largest_norm_of_rows_not_finite(backend, bad, want, row):
    vecs = np.ones((1000, 8), np.float32)
    vecs[row, 3] = bad
    got = backend.largest_norm(backend.ingest(vecs))
    if want == "nan":
        assert np.isnan(got)
    elif want == "inf":
        assert got == np.inf
    else:  # beyond float32 once squared and summed, not in float64
        assert got == pytest.approx(3e38, rel=1e-6)


def test_largest_norm_of_no_rows_and_zero_rows(backend):
    assert backend.largest_norm(backend.ingest(np.zeros((0, 4), np.float32))) == 0.0
    assert backend.largest_norm(backend.ingest(np.zeros((3, 4), np.float32))) == 0.0


def test_gpu_staging_model_declines_where_the_host_sets_the_pace():
    # The model the GPU's fast mode and certified route decline by (backends.cupy.backend.staging_bound), on the
    # cells it was measured on (docs/benchmarks.md, H100 2026-12-06): 1M users x 4,096 items x 64 with 50 pairs a
    # user (int64 given, int32 sent) is bound by the staging (the route 58.6 ms, its float32 search 52.4); 1M x 20k
    # x 32 l2 with as many is not (58.2 against 97.9); nor a few pairs, nor S1 with 200 a user.
    from recall.backends.cupy import backend as gpu_backend

    why = gpu_backend.staging_bound(1_000_000, 4096, 64, 50_000_000, 8)
    assert why is not None and "50,000,000 excluded pairs (600,000,000 bytes" in why, why
    assert gpu_backend.staging_bound(1_000_000, 20_000, 33, 50_000_000, 8) is None
    assert gpu_backend.staging_bound(1_000_000, 4096, 64, 1_000_000, 8) is None  # under STAGING_MIN_S
    assert gpu_backend.staging_bound(100_000, 1_000_000, 64, 20_000_000, 8) is None
    # Catalogues of 2^31 rows or more send int64: 16 bytes a pair.
    assert "(1,600,000,000 bytes" in gpu_backend.staging_bound(1, 1 << 31, 1, 100_000_000, 8)
