"""Exact mode's fused path on the GPU (recall/backends/cupy/kernels/fused.cu): scores filtered in the GEMM's registers.

Integer-valued data makes every float32 score exact whatever the summation order, so the fused path must equal the
CPU backend bit for bit there; on real-valued data it is checked against the float64 oracle (tie-aware).
"""
from __future__ import annotations

import numpy as np
import pytest

from dataclasses import replace

from recall import Engine, EngineOptions
from recall.backends import cuda_status

from oracle import as_numpy, assert_same_result as _same, assert_topk_close, int_matrix as _ints

usable, reason = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not usable, reason=f"no usable GPU: {reason}")]


@pytest.fixture
def fused():
    """The fused path on small problems: also unseeded, many blocks, segments of 3 tiles, 2 tiles per kernel block."""
    return EngineOptions(fused="force", fused_segment=384, fused_tiles_per_block=2, tiles=(200, 300, 3))


def _gpu(items, options=None):
    return Engine(items, device="gpu", options=options)


@pytest.mark.parametrize("n_users,n_items,dim,k", [
    (1, 1, 1, 1), (1, 300, 5, 300), (3, 129, 31, 7), (700, 2500, 12, 37), (130, 1000, 33, 10), (257, 3001, 256, 64),
    (50, 5000, 64, 1000),
])
def test_equals_cpu_exactly(fused, n_users, n_items, dim, k):
    rng = np.random.default_rng(n_users + n_items + dim)
    items, users = _ints(rng, n_items, dim), _ints(rng, n_users, dim)
    gpu = _gpu(items, fused)
    got = gpu.search(users, k)
    assert gpu.stats["fused"]
    _same(got, Engine(items, device="cpu").search(users, k))


@pytest.mark.parametrize("dim", [64, 21, 100, 29])
def test_l2_and_widths_off_the_chunk_equal_cpu_exactly(fused, dim):
    # l2's bias column makes 64 dimensions 68 (72 multiplied, the last chunk of 32 taking 8 rows), 21 makes 24, 100
    # makes 104 (8 rows of a fourth chunk), 29 makes 32: the kernel multiplies only those rows, and the merge's
    # recomputation the same ones in the same order (ip, unseeded at k = 300, one segment of all 20,000 items: every
    # user's buffer of 16,384 overflows and the segment is recomputed). Integer data: the CPU's answer bit for bit.
    rng = np.random.default_rng(40 + dim)
    items, users = _ints(rng, 20000, dim), _ints(rng, 260, dim)
    exclude = {3: list(range(0, 20000, 5))}
    for metric, k in (("l2", 40), ("ip", 300)):
        gpu = Engine(items, metric=metric, device="gpu", options=replace(fused, fused_segment=20480))
        got = gpu.search(users, k, exclude=exclude)
        assert gpu.stats["fused"]
        _same(got, Engine(items, metric=metric, device="cpu").search(users, k, exclude=exclude))


def test_exclusions_all_excluded_and_empty(fused):
    rng = np.random.default_rng(1)
    items, users = _ints(rng, 3000, 16), _ints(rng, 450, 16)
    excl = {u: rng.choice(3000, 200, replace=False).tolist() for u in range(0, 450, 3)}
    excl[1] = list(range(3000))  # every item excluded: nothing to return
    excl[2] = []
    excl[4] = list(range(0, 3000, 2))  # half of them, among them every seed-sample row
    gpu = _gpu(items, fused)
    got = gpu.search(users, 50, exclude=excl)
    assert gpu.stats["fused"]
    _same(got, Engine(items, device="cpu").search(users, 50, exclude=excl))
    assert (as_numpy(got.indices)[1] == -1).all()


def test_ties_everywhere(fused):
    rng = np.random.default_rng(2)
    items, users = _ints(rng, 6000, 12, -1, 2), _ints(rng, 300, 12, -1, 2)
    _same(_gpu(items, fused).search(users, 77), Engine(items, device="cpu").search(users, 77))


def test_seeded_auto_on_rising_order_against_oracle():
    # The default mode on a seeded search (tiles of 2,000 items: a sample of 2,000); items sorted by rising score,
    # the order that fills candidate buffers.
    options = EngineOptions(fused_segment=2048, tiles=(256, 1000, 2))
    rng = np.random.default_rng(3)
    items = rng.standard_normal((40000, 24), dtype=np.float32)
    users = rng.standard_normal((600, 24), dtype=np.float32) + 1.5
    items = items[np.argsort(items @ users.mean(axis=0), kind="stable")]
    excl = {5: list(range(39000, 40000)), 6: list(range(0, 40000, 7))}
    gpu = _gpu(items, options)
    got = gpu.search(users, 100, exclude=excl)
    assert gpu.stats["fused"] and gpu.stats["seed_sample"] > 0
    assert_topk_close(got.indices, got.scores, users, items, 100, exclude=excl)


@pytest.mark.parametrize("first", [128, 1000, 4096, "auto"])
@pytest.mark.parametrize("certified", ["off", "on"])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_first_segment_equals_cpu_exactly(first, certified, metric):
    # A seeded search's first launch over `first` items (EngineOptions.fused_first_segment; 1,000 rounds up to 8
    # tiles; "auto": sqrt(sample x items) where the sample is evenly spaced, as l2's is), whose merge raises the
    # thresholds, then segments of 8,192: the float32 search and the certified route (float16 pass and
    # re-scoring). Integer data (ties), a user with every item excluded, one with half, one left with fewer than k
    # items: the CPU's answer bit for bit.
    rng = np.random.default_rng(7 if first == "auto" else first)
    items, users = _ints(rng, 20000, 24), _ints(rng, 300, 24)
    excl = {1: list(range(20000)), 2: list(range(0, 20000, 2)), 3: list(range(20000 - 5))}
    options = EngineOptions(fused_first_segment=first, fused_segment=8192, certified_exact=certified)
    gpu = Engine(items, metric=metric, device="gpu", options=options)
    got = gpu.search(users, 10, exclude=excl)
    assert gpu.stats["fused"] and gpu.stats["seed_sample"] > 0, gpu.stats
    if first != "auto":
        assert gpu.stats["fused_first_segment"] == first, gpu.stats
    elif metric == "l2":
        assert 0 < gpu.stats["fused_first_segment"] <= 10000, gpu.stats
    assert gpu.stats.get("route") == ("certified" if certified == "on" else None), gpu.stats
    _same(got, Engine(items, metric=metric, device="cpu").search(users, 10, exclude=excl))
    assert (as_numpy(got.indices)[1] == -1).all() and (as_numpy(got.indices)[3][5:] == -1).all()


def test_overflow_recompute_equals_cpu(fused):
    # Unseeded, one segment of 128-item tiles per merge and k close to the item count: every user's buffer overflows
    # (a buffer holds 16384 candidates; a segment passes all of its 20480 scores), so each merge recomputes.
    rng = np.random.default_rng(4)
    items, users = _ints(rng, 41000, 8), _ints(rng, 70, 8)
    excl = {3: list(range(0, 41000, 3))}
    gpu = _gpu(items, replace(fused, fused_segment=20480))
    got = gpu.search(users, 500, exclude=excl)
    assert gpu.stats["fused"] and gpu.stats["seed_sample"] == 0
    _same(got, Engine(items, device="cpu").search(users, 500, exclude=excl))


def test_k_8192(fused):
    rng = np.random.default_rng(5)
    items, users = _ints(rng, 30000, 8), _ints(rng, 40, 8)
    _same(_gpu(items, fused).search(users, 8192), Engine(items, device="cpu").search(users, 8192))


def test_device_users_and_graph_replay_equal_eager(fused):
    import cupy

    rng = np.random.default_rng(6)
    items, users = rng.standard_normal((5000, 40), dtype=np.float32), rng.standard_normal((900, 40), dtype=np.float32)
    graphs = _gpu(items, fused)
    on_device = graphs.search(cupy.asarray(users), 30)
    assert graphs.stats["graph_blocks"] > 0
    _same(on_device, _gpu(items, replace(fused, cuda_graphs=False)).search(users, 30))
    assert_topk_close(as_numpy(on_device.indices), as_numpy(on_device.scores), users, items, 30)


def test_fused_equals_cublas_path_on_integer_data():
    rng = np.random.default_rng(7)
    items, users = _ints(rng, 80000, 64), _ints(rng, 500, 64)
    fused_engine = _gpu(items)
    got = fused_engine.search(users, 100, exclude={0: [1, 2, 3]})
    assert fused_engine.stats["fused"]
    plain = _gpu(items, EngineOptions(fused="off"))
    want = plain.search(users, 100, exclude={0: [1, 2, 3]})
    assert not plain.stats["fused"]
    _same(got, want)


@pytest.mark.parametrize("segment, takes_fused", [(4096, True), (16384, False)])
def test_large_k_unseeded_takes_the_fused_path_where_two_segments_fit(segment, takes_fused):
    # Unseeded, "auto" fuses once a user's candidate buffer (16,384 keys at k = 300) holds two whole segments: the
    # first segments pass every score and must not overflow it. Either way the answer is the CPU's, with exclusions
    # and ties (integer data), over several blocks.
    rng = np.random.default_rng(11)
    items, users = _ints(rng, 60000, 24), _ints(rng, 700, 24)
    exclude = {u: rng.choice(60000, 50, replace=False) for u in range(0, 700, 3)}
    gpu = _gpu(items, EngineOptions(seed_thresholds=False, fused_segment=segment, tiles=(256, 2048, 2)))
    got = gpu.search(users, 300, exclude=exclude)
    assert gpu.stats["fused"] == takes_fused and gpu.stats["seed_sample"] == 0
    _same(got, Engine(items, device="cpu").search(users, 300, exclude=exclude))


def test_wide_vectors_take_the_cublas_path(fused):
    rng = np.random.default_rng(8)
    items, users = _ints(rng, 2000, 260), _ints(rng, 50, 260)
    gpu = _gpu(items, fused)
    _same(gpu.search(users, 10), Engine(items, device="cpu").search(users, 10))
    assert not gpu.stats["fused"]


def test_transposed_items_kept_per_engine(fused):
    # The fused operand is built once per engine (its resident items): a second search reuses it, and an engine of
    # other items of the same shape, or of fewer columns, has its own, never the first one's numbers.
    rng = np.random.default_rng(5)
    a, b = _ints(rng, 1000, 40), _ints(rng, 1000, 40)
    first = _gpu(a, fused)
    items_t = first.resident_items.transposed(first.backend.compute_stream)
    assert first.resident_items.transposed(first.backend.compute_stream) is items_t
    for arr in (b, a, b[:997, :33]):
        engine = _gpu(np.ascontiguousarray(arr), fused)
        # Filled on the compute stream: to_host waits for it (a plain copy on the default stream need not).
        t = engine.backend.to_host(engine.resident_items.transposed(engine.backend.compute_stream))
        n, dim = arr.shape
        np.testing.assert_array_equal(t[:dim, :n], arr.T)
        assert not t[dim:].any() and not t[:, n:].any()
    users = _ints(rng, 300, 40)
    engine = _gpu(b, fused)
    _same(engine.search(users, 20), Engine(b, device="cpu").search(users, 20))
    _same(engine.search(users[:120], 7), Engine(b, device="cpu").search(users[:120], 7))


@pytest.mark.parametrize("mode", ["force", "off"])
def test_floor_returns_only_items_above_it(fused, mode):
    # A search with per-user floors (recall/jobs/early.py: the k-th best of the rows searched before) returns exactly
    # the items scoring above the floor, best first, then padding; equal to the floor is out (ties go to the lower
    # rows, searched before). Five blocks: the slots' graphs replay with the floors of other blocks.
    import cupy

    rng = np.random.default_rng(8)
    items, users = _ints(rng, 3000, 16), _ints(rng, 1000, 16)
    cpu = Engine(items, device="cpu").search(users, 40)
    floor = cpu.scores[:, 19].copy()
    floor[::7] = -np.inf  # no floor for some users
    gpu = _gpu(items, replace(fused, fused=mode))
    topk = gpu.search_topk(users, 40, floor=cupy.asarray(floor))
    assert topk.wait()["fused"] == (mode == "force")
    vals, rows = as_numpy(topk.vals), as_numpy(topk.rows)
    for u in range(len(users)):
        keep = cpu.scores[u] > floor[u]
        n = int(keep.sum())
        np.testing.assert_array_equal(rows[u, :n], cpu.indices[u, keep], err_msg=f"user {u}")
        np.testing.assert_array_equal(vals[u, :n], cpu.scores[u, keep])
        assert (rows[u, n:] == -1).all() and (vals[u, n:] == -np.inf).all()


# Fast mode's float16 kernel (kernels/fused_h.cu): small-integer float16 vectors give exact float32 scores in any
# order of summation, so the tensor cores' sums, the overflow merge's recomputed ones and the CPU's must be equal bit
# for bit, ties to the lower row.
def _run_half(device, items16, users16, k, exclude=None, options=None, device_users=False, best_first=True):
    from recall.core.exclusions import normalise

    engine = Engine(items16.astype(np.float32), device=device, options=options)
    backend = engine.backend
    resident = backend.load_items(backend.xp.asarray(items16))
    n = users16.shape[0]
    if device_users:
        users16 = backend.xp.asarray(users16)
    vals = backend.empty_out((n, k), np.float32, False)
    rows = backend.empty_out((n, k), np.int64, False)
    stats = engine.run(users16, k, normalise(exclude, n, items16.shape[0]), vals, rows, items=resident,
                       best_first=best_first)()
    return as_numpy(vals), as_numpy(rows), stats


def _best_first(vals, rows):
    """Each row's (score, item row) pairs sorted as results are: score descending, lower row first, empty last."""
    order = np.lexsort((np.where(rows < 0, np.iinfo(np.int64).max, rows), -vals), axis=1)
    return np.take_along_axis(vals, order, 1), np.take_along_axis(rows, order, 1)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("mode", ["force", "off"])
@pytest.mark.parametrize("k", [7, 1000, 1251])
def test_a_pass_in_no_order_holds_the_sorted_passs_results(fused, dtype, mode, k):
    # Backend.run_blocks' best_first=False (fast mode's pass, re-ranked after): the final merge skips its sort and
    # writes the k it kept as selected. The same pairs as the sorted pass, empty slots (an all-excluded user, users
    # with fewer items than k) after them; the fused kernels (mode "force") and cuBLAS + filter ("off"), float16 and
    # float32 vectors. Small-integer data: ties everywhere, decided by the row.
    rng = np.random.default_rng(k)
    items = _ints(rng, 3000, 24).astype(dtype)
    users = _ints(rng, 300, 24).astype(dtype)
    excl = {u: rng.choice(3000, 2500, replace=False).tolist() for u in range(1, 300, 7)}
    excl[0] = list(range(3000))
    options = replace(fused, fused=mode)
    want_vals, want_rows, stats = _run_half("gpu", items, users, k, excl, options)
    assert stats["fused"] == (mode == "force")
    got_vals, got_rows, _ = _run_half("gpu", items, users, k, excl, options, best_first=False)
    np.testing.assert_array_equal(want_rows, _best_first(want_vals, want_rows)[1])  # the sorted pass is sorted
    if k >= 1000:
        assert not np.array_equal(got_rows, want_rows)  # and the other is not: its sort was skipped
    got_vals, got_rows = _best_first(got_vals, got_rows)
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_vals, want_vals)


def _counted_warp_merges(monkeypatch, backend):
    """``backend``'s warp merge kernels wrapped to count their launches: the list each launch appends to."""
    calls = []
    for table in (backend.selection.merge_fused_warp, backend.selection.merge_fused_h_warp):
        for key, fn in list(table.items()):
            monkeypatch.setitem(table, key, lambda *a, fn=fn, **kw: (calls.append(1), fn(*a, **kw))[1])
    return calls


def _block_then_warp_merges(monkeypatch, backend, calls, items, users, k, excl, options, best_first):
    """((vals, rows) of the pass with every merge a block's, (vals, rows) with fused.MERGE_WARP_K's warps), best
    first; the first asserted fused with no warp merge, the second with some (``calls``: _counted_warp_merges')."""
    from recall.backends.cupy import fused as fused_module

    monkeypatch.setattr(fused_module, "MERGE_WARP_K", 0)
    want_vals, want_rows, stats = _run_half(backend, items, users, k, excl, options, best_first=best_first)
    assert stats["fused"] and not calls
    monkeypatch.setattr(fused_module, "MERGE_WARP_K", 64)
    got_vals, got_rows, _ = _run_half(backend, items, users, k, excl, options, best_first=best_first)
    assert calls
    calls.clear()
    if not best_first:
        return _best_first(want_vals, want_rows), _best_first(got_vals, got_rows)
    return (want_vals, want_rows), (got_vals, got_rows)


@pytest.mark.parametrize("held", [8, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("k", [1, 10, 27, 32, 33, 64])
@pytest.mark.parametrize("best_first", [True, False])
def test_warp_merge_equals_the_block_merge(monkeypatch, held, dtype, k, best_first):
    # fused.MERGE_WARP_K: a user keeping at most 64 keys is merged by one warp, each lane holding `held` of its keys
    # in registers; a user with more keys than the warp holds, or whose buffer overflowed, by the block merge's radix
    # select run by that warp. Real-valued data; segments of 384 items seeded (folds of few candidates), unseeded
    # (every merge takes 384 candidates and the state's keys: more than 8 x 32), unseeded segments of 20,480 (every
    # buffer of 16,384 overflows and the segment is recomputed); exclusions, an all-excluded user, users left fewer
    # items than k. The warp merges' results equal the block merge's bit for bit, sorted and in no order, and the
    # warp kernels ran.
    from recall.backends.cupy import fused as fused_module

    rng = np.random.default_rng(k + held)
    items = rng.standard_normal((41000, 24)).astype(dtype)
    users = rng.standard_normal((90, 24)).astype(dtype)
    excl = {u: rng.choice(41000, 500, replace=False).tolist() for u in range(2, 90, 5)}
    excl[0] = list(range(41000))
    excl[1] = list(range(3, 41000))  # 3 items left
    excl[7] = list(range(k // 2, 41000))  # fewer than k left, where k > 1
    backend = Engine(items[:1].astype(np.float32), device="gpu").backend  # one backend, its kernels counted
    calls = _counted_warp_merges(monkeypatch, backend)
    monkeypatch.setattr(fused_module, "MERGE_WARP_HELD", held)
    for options in (EngineOptions(fused="force", fused_segment=384),
                    EngineOptions(fused="force", fused_segment=384, seed_thresholds=False),
                    EngineOptions(fused="force", fused_segment=20480, seed_thresholds=False)):
        (want_vals, want_rows), (got_vals, got_rows) = _block_then_warp_merges(
            monkeypatch, backend, calls, items, users, k, excl, options, best_first)
        np.testing.assert_array_equal(got_rows, want_rows)
        np.testing.assert_array_equal(got_vals, want_vals)
        assert (got_rows[0] == -1).all() and (got_rows[1][3:] == -1).all() and (got_rows[7][k // 2:] == -1).all()


@pytest.mark.parametrize("n_items", [20, 50, 100, 130, 200, 256, 257, 300, 700, 1023, 1024])
@pytest.mark.parametrize("k", [1, 10, 27, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("best_first", [True, False])
def test_warp_merge_over_one_to_eight_registers_equals_the_block_merge(monkeypatch, n_items, k, dtype, best_first):
    # Unseeded, a catalogue in one segment: every item survives, so the one merge holds n_items keys a user, in 1, 2,
    # 4, 5, 7 and 8 of the warp's registers (each width of topk.cu's recall_warp_least); past 256 the rest read from
    # the buffer at each count (1 to 767 of them, up to RECALL_MERGE_STREAM_MAX = 1,023 keys), and 1,024 keys take the
    # radix select. Half the items are copies of three vectors: keys that differ in their row bits alone, down to the
    # last bit. Bit for bit the block merge's.
    rng = np.random.default_rng(n_items + k)
    items = rng.standard_normal((n_items, 24)).astype(dtype)
    items[::2] = items[[0, 1, 2] * (n_items // 6 + 1)][: (n_items + 1) // 2]
    users = rng.standard_normal((130, 24)).astype(dtype)
    backend = Engine(items[:1].astype(np.float32), device="gpu").backend
    calls = _counted_warp_merges(monkeypatch, backend)
    (want_vals, want_rows), (got_vals, got_rows) = _block_then_warp_merges(
        monkeypatch, backend, calls, items, users, k, None, EngineOptions(fused="force", seed_thresholds=False),
        best_first)
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_vals, want_vals)
    assert (got_rows[:, :min(k, n_items)] >= 0).all() and (got_rows[:, n_items:] == -1).all()


@pytest.mark.parametrize("n_users,n_items,width,k", [
    (1, 1, 8, 1), (3, 129, 16, 7), (130, 1000, 24, 10), (300, 3001, 72, 64), (257, 2500, 128, 100),
    (129, 700, 120, 30), (700, 5000, 40, 1000), (200, 1300, 112, 16), (60, 900, 56, 5), (150, 2000, 96, 20),
    (140, 2100, 88, 9),
])
def test_half_fused_equals_cpu_exactly(fused, n_users, n_items, width, k):
    rng = np.random.default_rng(n_users + n_items + width)
    items = _ints(rng, n_items, width).astype(np.float16)
    users = _ints(rng, n_users, width).astype(np.float16)
    excl = {u: rng.choice(n_items, n_items // 3, replace=False).tolist() for u in range(0, n_users, 5)}
    excl[0] = list(range(n_items))  # every item excluded
    got_vals, got_rows, stats = _run_half("gpu", items, users, k, excl, fused)
    assert stats["fused"] and stats["score_dtype"] == "float32"
    want_vals, want_rows, _ = _run_half("cpu", items, users, k, excl)
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_vals, want_vals)
    assert (got_rows[0] == -1).all()


@pytest.mark.parametrize("warpgroup", [True, False])
@pytest.mark.parametrize("n_users,n_items,width,k", [
    (1, 1, 8, 1), (3, 129, 16, 7), (300, 3001, 72, 64), (257, 2500, 128, 100), (129, 700, 120, 30),
    (700, 5000, 40, 1000), (150, 2000, 96, 20), (140, 2100, 88, 9), (200, 1300, 112, 16), (260, 2300, 136, 50),
    (130, 1500, 144, 12),
])
def test_half_fused_both_tensor_core_kernels(warpgroup, n_users, n_items, width, k):
    # fused_w.cu (wgmma, Hopper) and fused_h.cu (mma.sync): on integer data both equal the CPU bit for bit; the
    # launches are counted, so that the kernel asked for is the one that ran (off Hopper only fused_h.cu exists).
    # Rows of 136 and 144 columns: the wgmma kernel's alone (fused.FUSED_W_MAX_WIDTH); elsewhere cuBLAS + filter.
    import cupy

    rng = np.random.default_rng(n_users + 3 * width + k)
    items = _ints(rng, n_items, width).astype(np.float16)
    users = _ints(rng, n_users, width).astype(np.float16)
    excl = {u: rng.choice(n_items, n_items // 4, replace=False).tolist() for u in range(1, n_users, 6)}
    options = EngineOptions(fused="force", fused_segment=384, fused_tiles_per_block=2, tiles=(200, 300, 3),
                            warpgroup_mma=warpgroup)
    engine = Engine(items.astype(np.float32), device="gpu", options=options)
    sel = engine.backend.selection
    hopper = cupy.cuda.Device().compute_capability == "90"
    assert bool(sel.fused_w) == hopper
    calls = {"w": 0, "h": 0}

    class Counted:  # a kernel whose launches are counted; its attributes (the shared-memory limit) are the kernel's
        def __init__(self, fn, kind):
            object.__setattr__(self, "fn", fn)
            object.__setattr__(self, "kind", kind)

        def __call__(self, *a, **kw):
            calls[self.kind] += 1
            return self.fn(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.fn, name)

        def __setattr__(self, name, value):
            setattr(self.fn, name, value)

    from recall.core.exclusions import normalise

    saved = [(table, dict(table)) for table in (sel.fused_w, sel.fused_h)]  # the device's selection is shared
    try:
        for table, kind in ((sel.fused_w, "w"), (sel.fused_h, "h")):
            for key in list(table):
                table[key] = Counted(table[key], kind)
        backend = engine.backend
        resident = backend.load_items(backend.xp.asarray(items))
        vals = backend.empty_out((n_users, k), np.float32, False)
        rows = backend.empty_out((n_users, k), np.int64, False)
        stats = engine.run(users, k, normalise(excl, n_users, n_items), vals, rows, items=resident)()
    finally:
        for table, kept in saved:
            table.update(kept)
    wgmma = warpgroup and hopper
    if width > 128 and not wgmma:
        assert not stats["fused"] and calls == {"w": 0, "h": 0}
    else:
        assert stats["fused"] and stats["score_dtype"] == "float32"
        assert calls["w" if wgmma else "h"] > 0 and calls["h" if wgmma else "w"] == 0
    want_vals, want_rows, _ = _run_half("cpu", items, users, k, excl)
    np.testing.assert_array_equal(as_numpy(rows), want_rows)
    if stats["fused"]:  # cuBLAS + filter keeps float16 scores, not the float32 ones this buffer holds
        np.testing.assert_array_equal(as_numpy(vals), want_vals)


def test_an_nvrtc_that_cannot_build_sm90a_leaves_the_mma_kernel_and_says_so(monkeypatch, caplog):
    from recall.backends.cupy import kernels
    from recall.backends.cupy.selection import Selection

    def fails():
        raise RuntimeError("NVRTC could not build fused_w.cu for sm_90a: invalid value for --gpu-architecture")

    monkeypatch.setattr(kernels, "hopper_fused_module", fails)
    with caplog.at_level("WARNING", logger="recall"):
        assert Selection().fused_w == {}
    assert "wgmma kernels could not be built" in caplog.text and "mma.sync kernel runs instead" in caplog.text


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("dim,k", [(32, 10), (64, 100), (120, 1000), (128, 64)])
def test_hopper_and_mma_kernels_give_the_exact_answer_on_real_data(metric, dim, k):
    # Real-valued, skewed-norm data through fast and exact mode's float16 passes with either kernel: the answers
    # (re-scored) equal the float64 oracle's, ties aware, and the two kernels' answers are the same.
    rng = np.random.default_rng(dim + k)
    items = (rng.standard_normal((6000, dim)) * rng.lognormal(0, 0.6, (6000, 1))).astype(np.float32)
    users = (rng.standard_normal((400, dim)) * rng.lognormal(0, 0.6, (400, 1))).astype(np.float32)
    answers = []
    for warpgroup in (True, False):
        options = EngineOptions(fused="force", fused_segment=1024, warpgroup_mma=warpgroup, certified_exact="on",
                                float16_min_scores=0)
        for precision in ("fast", "exact"):
            engine = Engine(items, device="gpu", metric=metric, precision=precision, options=options)
            got = engine.search(users, k)
            idx, val = as_numpy(got.indices), as_numpy(got.scores)
            assert_topk_close(idx, val, users, items, k, metric=metric)
            answers.append((idx, val))
    for a, b in zip(answers[:2], answers[2:]):  # fast, exact with wgmma; fast, exact with mma.sync
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_half_fused_overflow_recompute_and_seeded_auto():
    # Unseeded with segments of 20,480 items and k = 500: every buffer overflows and each merge recomputes the
    # segment; then the default mode on a catalogue large enough to seed.
    rng = np.random.default_rng(9)
    items = _ints(rng, 41000, 24).astype(np.float16)
    users = _ints(rng, 70, 24).astype(np.float16)
    excl = {3: list(range(0, 41000, 3))}
    options = EngineOptions(fused="force", seed_thresholds=False, fused_segment=20480)
    got_vals, got_rows, stats = _run_half("gpu", items, users, 500, excl, options)
    assert stats["fused"] and stats["seed_sample"] == 0
    want_vals, want_rows, _ = _run_half("cpu", items, users, 500, excl)
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_vals, want_vals)

    items = _ints(rng, 70000, 40).astype(np.float16)
    users = _ints(rng, 600, 40).astype(np.float16)
    got_vals, got_rows, stats = _run_half("gpu", items, users, 100, excl, EngineOptions(tiles=(256, 4096, 2)))
    assert stats["fused"] and stats["seed_sample"] > 0 and stats["score_dtype"] == "float32"
    want_vals, want_rows, _ = _run_half("cpu", items, users, 100, excl)
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_vals, want_vals)


def test_half_wider_than_the_kernel_takes_the_cublas_path():
    # 152 columns: wider than either float16 kernel (fused.FUSED_W_MAX_WIDTH on Hopper, FUSED_H_MAX_WIDTH elsewhere).
    rng = np.random.default_rng(12)
    items = _ints(rng, 900, 152, -1, 2).astype(np.float16)  # scores within float16's integers: tiles keep them
    users = _ints(rng, 40, 152, -1, 2).astype(np.float16)
    _, rows, stats = _run_half("gpu", items, users, 9, None, EngineOptions(fused="force"))
    assert not stats["fused"] and stats["score_dtype"] == "float16"
    _, want_rows, _ = _run_half("cpu", items, users, 9)
    np.testing.assert_array_equal(rows, want_rows)


def test_half_off_keeps_float16_tiles():
    rng = np.random.default_rng(10)
    items = _ints(rng, 3000, 24).astype(np.float16)
    users = _ints(rng, 50, 24).astype(np.float16)
    _, rows, stats = _run_half("gpu", items, users, 20, None, EngineOptions(fused="off"))
    assert not stats["fused"] and stats["score_dtype"] == "float16"
    _, want_rows, _ = _run_half("cpu", items, users, 20)
    np.testing.assert_array_equal(rows, want_rows)


@pytest.mark.parametrize("width,zero_from,held,multiplied", [
    (72, 64, None, 64),  # fast mode's d = 64 without a shift or bound columns: 64 columns, not 80
    (72, 64, 70, 80),  # one user's value in the last step: it must count
    (40, 32, None, 32),  # d = 32: 32, not 48
    (136, 128, None, 128),  # rows wider than the kernel multiplies whole, taken by it all the same
])
def test_half_fused_multiplies_only_the_columns_some_user_holds(fused, width, zero_from, held, multiplied):
    rng = np.random.default_rng(width + zero_from)
    items = _ints(rng, 2000, width).astype(np.float16)  # every column of the items holds values
    users = _ints(rng, 300, width).astype(np.float16)
    users[:, zero_from:] = 0
    users[5, zero_from] = -0.0  # -0 is 0: it adds nothing
    if held is not None:
        users[77, held] = 3
    excl = {u: rng.choice(2000, 300, replace=False).tolist() for u in range(0, 300, 7)}
    got_vals, got_rows, stats = _run_half("gpu", items, users, 40, excl, fused, device_users=True)
    assert stats["fused"] and stats["multiplied_columns"] == multiplied, stats
    want_vals, want_rows, _ = _run_half("cpu", items, users, 40, excl)
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_vals, want_vals)
    # Host users are multiplied whole (a NumPy pass over float16 rows costs more than it saves): the same answer
    # (rows wider than 128 columns then take cuBLAS and its float16 tiles, which do not keep these scores exactly).
    if width <= 128:
        host_vals, host_rows, host_stats = _run_half("gpu", items, users, 40, excl, fused)
        assert host_stats["fused"] and "multiplied_columns" not in host_stats, host_stats
        np.testing.assert_array_equal(host_rows, want_rows)
        np.testing.assert_array_equal(host_vals, want_vals)


@pytest.mark.parametrize("width", [16, 32, 48, 64, 80, 96, 112, 128, 144])
@pytest.mark.parametrize("rank,capacity", [(3, 4096), (40, 4096), (150, 4096), (600, 4096), (600, 200)])
def test_wgmma_kernel_keeps_every_survivor_past_its_stage(width, rank, capacity):
    # fused_w.cu keeps a block's survivors of a user in shared memory (RW_STAGED_OF: 4 to 96 of them), past that in
    # the buffer by a global atomic, and sends the stage out at the block's end. Thresholds from a few survivors a
    # block's user to hundreds (8 tiles of 128 items a block), into buffers that hold them all or overflow: every
    # user's count must be every score above its threshold, and the keys kept exactly such items, once each. 3,001
    # items: the last tile's rows past the catalogue taken off.
    import cupy

    from recall.backends.cupy import kernels
    from recall.backends.cupy.fused import wgmma_smem

    mod = kernels.hopper_fused_module()
    if mod is None:
        pytest.skip("fused_w.cu is built for compute capability 9.0 only")
    rng = np.random.default_rng(width + rank)
    n_users, n_items = 260, 3001
    users = _ints(rng, n_users, width).astype(np.float16)
    items = _ints(rng, n_items, width).astype(np.float16)
    exact = users.astype(np.float64) @ items.astype(np.float64).T  # integers: every float32 sum is exact
    thr = (np.sort(exact, axis=1)[:, -rank] - 0.5).astype(np.float32)  # ties at the rank all pass
    thr[7] = np.inf  # a user with no survivor
    fn = mod.get_function(f"recall_fused_filter_w{width // 16}")
    fn.max_dynamic_shared_size_bytes = wgmma_smem(width)
    cand = cupy.zeros((n_users, capacity), cupy.uint64)
    cnt = cupy.zeros(n_users, cupy.int32)
    tiles = -(-n_items // 128)
    fn((-(-tiles // 8), -(-n_users // 128)), (256,),
       (cupy.asarray(users), np.int32(n_users), cupy.asarray(items), np.int32(n_items), np.int32(width),
        np.int32(width), np.int32(0), np.int32(tiles), np.int32(8), cupy.asarray(thr), cand, np.int32(capacity),
        cnt), shared_mem=wgmma_smem(width))
    counts, keys = cnt.get(), cand.get()
    want = exact > thr[:, None]
    np.testing.assert_array_equal(counts, want.sum(axis=1))
    for u in range(n_users):
        held = keys[u, :min(counts[u], capacity)]
        assert (held != 0).all()
        rows = (~(held & np.uint64(0xFFFFFFFF)).astype(np.uint32)).astype(np.int64)
        bits = (held >> np.uint64(32)).astype(np.uint32)
        scores = np.where(bits & np.uint32(0x80000000), bits & np.uint32(0x7FFFFFFF), ~bits).astype(
            np.uint32).view(np.float32)
        assert np.unique(rows).size == rows.size and want[u, rows].all(), u
        np.testing.assert_array_equal(scores, exact[u, rows].astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("best_first", [True, False])
@pytest.mark.parametrize("where", ["host", "device", "strided"])
def test_final_merge_writes_device_results_in_place(monkeypatch, fused, dtype, best_first, where):
    # Blocks of at least pipeline.DIRECT_OUT_USERS users whose results go to device arrays of the search's width have
    # their final merge write there itself (eagerly, no graph), not through the state's buffers and a copy; device
    # users of C order are read where they are, not through the slot's copy (a strided view is copied). Here every
    # block of 200 (and the short last one of 101) does, against the copies of the rule before: the same answers, bit
    # for bit, with exclusions, an all-excluded user and ties (small-integer data), sorted or kept in no order, users
    # from the host, the device and a strided device view, and the CPU's answer.
    from recall.backends.cupy import pipeline

    rng = np.random.default_rng(31)
    items = _ints(rng, 3000, 24).astype(dtype)
    users = _ints(rng, 701, 24).astype(dtype)
    excl = {u: rng.choice(3000, 900, replace=False).tolist() for u in range(1, 701, 9)}
    excl[5] = list(range(3000))
    k = 45
    searched = users
    if where != "host":
        import cupy

        wide = np.zeros((701, 40), dtype)
        wide[:, :24] = users
        searched = cupy.asarray(users) if where == "device" else cupy.asarray(wide)[:, :24]
        assert searched.flags.c_contiguous == (where == "device")
    monkeypatch.setattr(pipeline, "DIRECT_OUT_USERS", 2 ** 62)
    want_vals, want_rows, _ = _run_half("gpu", items, users, k, excl, fused, best_first=best_first)
    monkeypatch.setattr(pipeline, "DIRECT_OUT_USERS", 100)
    got_vals, got_rows, stats = _run_half("gpu", items, searched, k, excl, fused, best_first=best_first)
    assert stats["fused"] and stats["blocks"] == 4 and stats["graph_blocks"] == 0  # in place: eager
    assert (got_rows[5] == -1).all() and np.isneginf(got_vals[5]).all()
    if not best_first:  # kept in no order: the order the survivors were appended in, run to run
        want_vals, want_rows = _best_first(want_vals, want_rows)
        got_vals, got_rows = _best_first(got_vals, got_rows)
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_vals, want_vals)
    cpu = Engine(items.astype(np.float32), device="cpu").search(users.astype(np.float32), k, exclude=excl)
    np.testing.assert_array_equal(got_rows, as_numpy(cpu.indices))


def test_in_place_results_need_device_rows_of_the_searchs_width():
    from recall.backends.cupy.pipeline import _direct_out

    vals, rows = np.zeros((10, 7), np.float32), np.zeros((10, 7), np.int64)
    assert _direct_out(vals, rows, 7)
    assert not _direct_out(vals, rows, 6)  # wider rows than the search keeps: the copy fills their first k
    assert not _direct_out(np.zeros((10, 14), np.float32)[:, ::2], rows, 7)  # strided
    assert not _direct_out(vals, rows.astype(np.int32), 7)
    assert not _direct_out(vals.astype(np.float64), rows, 7)
