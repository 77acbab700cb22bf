"""Per-user candidate re-scoring (``Engine.rescore``, ``recall rescore``) against a float64 oracle.

Every Engine test takes ``device``: the same bodies run on the CPU backend here and on the GPU backend on a GPU machine
(``-m gpu``), where ``path`` also runs each body through both GPU paths (the fused kernel and gather + GEMM).
Integer-valued data makes float32 scores exact, so ip and l2 results (tie order included) must equal the oracle's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import oracle
from oracle import as_numpy
from parquet_data import write_embeddings
from recall import Engine, InputError, SearchResult, EngineOptions
from recall.cli.app import app
from recall.backends.cupy import rescore
from recall.backends.cupy.rescore import lanes, launch_config, smem_bytes, takes_warp, warp_smem_bytes
from recall.io import read_pairs
from recall.jobs import rescore_files

METRICS = ["ip", "cosine", "l2"]


@pytest.fixture(params=["fused", "gemm"])
def path(request: pytest.FixtureRequest) -> EngineOptions:
    """The GPU path to take (``EngineOptions.rescore``); the CPU backend always gathers and runs the GEMM."""
    return EngineOptions(rescore=request.param)


def _ints(rng: np.random.Generator, n: int, dim: int, lo: int = -2, hi: int = 2) -> np.ndarray:
    vecs = rng.integers(lo, hi + 1, (n, dim)).astype(np.float32)
    vecs[~vecs.any(axis=1), 0] = 1.0  # no zero rows: cosine needs a direction
    return vecs


def _lists(rng: np.random.Generator, n_users: int, n_items: int, longest: int) -> list[np.ndarray]:
    """Lists of varied length (some empty), with duplicates, in no particular order."""
    out = []
    for u in range(n_users):
        n = int(rng.integers(0, longest + 1)) if u % 7 else 0
        lst = rng.integers(0, n_items, n)
        if n > 2:
            lst[-1] = lst[0]  # a duplicate
        out.append(lst)
    return out


def _want(users, items, lists, k, metric="ip"):
    """float64 oracle: per user, the best k distinct candidates by (score desc, row asc), padded (-1, -inf), as
    wide as min(k, n_items)."""
    full = oracle.score_matrix(users, items, metric)
    k = min(k, len(items))
    idx = np.full((len(lists), k), -1, np.int64)
    val = np.full((len(lists), k), -np.inf)
    for u, lst in enumerate(lists):
        c = np.unique(np.asarray(lst, dtype=np.int64))
        top = c[np.lexsort((c, -full[u, c]))][:k]
        idx[u, :top.size] = top
        val[u, :top.size] = full[u, top]
    return idx, val


def _csr(lists):
    indptr = np.zeros(len(lists) + 1, np.int64)
    np.cumsum([len(x) for x in lists], out=indptr[1:])
    rows = np.concatenate([np.asarray(x, np.int64) for x in lists]) if lists else np.zeros(0, np.int64)
    return indptr, rows


def _check(res: SearchResult, users, items, lists, k, metric):
    idx, val = as_numpy(res.indices), as_numpy(res.scores)
    want_idx, want_val = _want(users, items, lists, k, metric)
    assert idx.shape == (len(lists), min(k, len(items))) and idx.dtype == np.int64 and val.dtype == np.float32
    if metric == "cosine":
        np.testing.assert_array_equal(idx < 0, want_idx < 0)
        real = want_idx >= 0
        np.testing.assert_allclose(val[real], want_val[real], rtol=1e-5, atol=1e-6)
        assert np.all(np.isneginf(val[~real]))
        # every returned item is one of the user's candidates and appears once
        for u, lst in enumerate(lists):
            got = idx[u][idx[u] >= 0]
            assert set(got) <= set(np.asarray(lst).tolist()) and len(set(got)) == got.size
    else:
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(val, want_val.astype(np.float32))


# ---- correctness against the oracle ------------------------------------------------------------------------------

@pytest.mark.parametrize("metric", METRICS)
def test_every_metric_matches_oracle(device, path, metric):
    rng = np.random.default_rng(1)
    items, users = _ints(rng, 400, 12), _ints(rng, 60, 12)
    lists = _lists(rng, 60, 400, 40)
    engine = Engine(items, metric=metric, device=device, options=path)
    for k in (1, 7, 50):  # 50: more than most lists hold
        _check(engine.rescore(users, lists, k), users, items, lists, k, metric)


def test_normal_data_matches_oracle(device, path, make_clustered):
    users, items = make_clustered(50, 3000, 32, seed=3)
    rng = np.random.default_rng(3)
    lists = [rng.choice(3000, int(rng.integers(100, 700)), replace=False) for _ in range(50)]
    for metric in METRICS:
        res = Engine(items, metric=metric, device=device, options=path).rescore(users, lists, 20)
        idx, val = as_numpy(res.indices), as_numpy(res.scores)
        # Each user's candidates are a sub-catalogue: the oracle helper applies with the others excluded.
        banned = np.ones((50, 3000), bool)
        for u, lst in enumerate(lists):
            banned[u, lst] = False
        exclude = {u: np.flatnonzero(banned[u]).tolist() for u in range(50)}
        oracle.assert_topk_close(idx, val, users, items, 20, metric, exclude=exclude)


def test_ties_go_to_the_lower_item_row(device, path):
    items = np.ones((30, 4), np.float32)  # every candidate scores the same
    items[7] = 2.0
    users = np.ones((3, 4), np.float32)
    lists = [[29, 3, 17, 7, 3, 0], [5, 4], list(range(29, -1, -1))]
    res = Engine(items, device=device, options=path).rescore(users, lists, 4)
    np.testing.assert_array_equal(as_numpy(res.indices), [[7, 0, 3, 17], [4, 5, -1, -1], [7, 0, 1, 2]])
    np.testing.assert_array_equal(as_numpy(res.scores)[0], [8, 4, 4, 4])


def test_duplicates_count_once(device, path):
    rng = np.random.default_rng(2)
    items, users = _ints(rng, 50, 8), _ints(rng, 4, 8)
    lists = [[5, 5, 5, 5], [9, 3, 9, 3, 9], [1] * 300 + [2] * 300, []]
    res = Engine(items, device=device, options=path).rescore(users, lists, 3)
    idx = as_numpy(res.indices)
    assert (idx[0] >= 0).sum() == 1 and idx[0, 0] == 5
    assert sorted(idx[1][:2].tolist()) == [3, 9] and idx[1, 2] == -1
    assert sorted(idx[2][:2].tolist()) == [1, 2] and idx[2, 2] == -1
    assert (idx[3] == -1).all() and np.isneginf(as_numpy(res.scores)[3]).all()


def test_empty_lists_and_no_users(device, path):
    rng = np.random.default_rng(3)
    items, users = _ints(rng, 20, 4), _ints(rng, 5, 4)
    engine = Engine(items, device=device, options=path)
    res = engine.rescore(users, [[] for _ in range(5)], 3)
    assert (as_numpy(res.indices) == -1).all() and np.isneginf(as_numpy(res.scores)).all()
    res = engine.rescore(np.zeros((0, 4), np.float32), (np.zeros(1, np.int64), np.zeros(0, np.int64)), 3)
    assert as_numpy(res.indices).shape == (0, 3)


def test_csr_lists_and_matrix_agree(device, path):
    rng = np.random.default_rng(4)
    items, users = _ints(rng, 100, 8), _ints(rng, 9, 8)
    matrix = rng.integers(0, 100, (9, 25))
    engine = Engine(items, device=device, options=path)
    a = engine.rescore(users, list(matrix), 6)
    b = engine.rescore(users, _csr(list(matrix)), 6)
    c = engine.rescore(users, matrix, 6)
    d = engine.rescore(users, [row.tolist() for row in matrix], 6)
    for other in (b, c, d):
        np.testing.assert_array_equal(as_numpy(a.indices), as_numpy(other.indices))
        np.testing.assert_array_equal(as_numpy(a.scores), as_numpy(other.scores))
    _check(a, users, items, list(matrix), 6, "ip")


def test_a_search_s_padded_indices_are_candidates_as_they_are(device, path):
    # A search's indices, -1 where it found fewer than k (an allow filter), re-scored as they are: -1 is no
    # candidate in a matrix; any other row out of range is still refused.
    rng = np.random.default_rng(9)
    items, users = _ints(rng, 60, 8), _ints(rng, 7, 8)
    engine = Engine(items, device=device, options=path)
    found = engine.search(users, 10, allow=np.arange(0, 60, 10))  # 6 pass: 4 slots of padding a user
    indices = as_numpy(found.indices)
    assert (indices[:, 6:] == -1).all()
    got = engine.rescore(users, indices, 10)
    np.testing.assert_array_equal(as_numpy(got.indices), indices)
    np.testing.assert_array_equal(as_numpy(got.scores), as_numpy(found.scores))
    mixed = indices.copy()
    mixed[2, 0], mixed[3] = -1, -1  # padding anywhere, a user with none
    want = engine.rescore(users, [row[row >= 0] for row in mixed], 10)
    got = engine.rescore(users, mixed, 10)
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))
    assert (as_numpy(got.indices)[3] == -1).all()
    mixed[4, 1] = -2
    with pytest.raises(InputError, match="user row 4 has item row -2 at position 1 of its list"):
        engine.rescore(users, mixed, 10)
    mixed[4, 1], mixed[5, :2], mixed[5, 3] = 1, -1, 60  # positions count the matrix's columns, padding included
    with pytest.raises(InputError, match="user row 5 has item row 60 at position 3 of its list"):
        engine.rescore(users, mixed, 10)


def test_long_lists_and_tiny_budget_agree(device, path):
    """Lists longer than one sort chunk of the GPU kernel (4,096) and than a whole CPU block under a tiny budget."""
    rng = np.random.default_rng(5)
    items, users = _ints(rng, 6000, 8, -3, 3), _ints(rng, 6, 8, -3, 3)
    lists = [rng.integers(0, 6000, 9000), rng.integers(0, 6000, 5), np.arange(6000)[::-1], [], [17] * 5000,
             rng.integers(0, 6000, 4097)]
    want = Engine(items, device=device, options=path).rescore(users, lists, 40)
    _check(want, users, items, lists, 40, "ip")
    tiny = Engine(items, device=device, memory_budget=20_000, options=path).rescore(users, lists, 40)
    np.testing.assert_array_equal(as_numpy(tiny.indices), as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(tiny.scores), as_numpy(want.scores))


def test_k_above_4096_keys_in_one_chunk(device, path):
    """k = 3,000 (K_pad 4,096): lists that fit in one chunk of K_pad keys (with duplicates, ties and a list as long
    as the chunk), and one a key longer, which takes two."""
    rng = np.random.default_rng(15)
    items, users = _ints(rng, 6000, 8, -3, 3), _ints(rng, 5, 8, -3, 3)
    lists = [rng.integers(0, 6000, 3751), rng.permutation(6000)[:4096], rng.integers(0, 6000, 2999), [3, 3, 2],
             rng.integers(0, 6000, 4097)]
    one = Engine(items, device=device, options=path).rescore(users[:4], lists[:4], 3000)
    _check(one, users[:4], items, lists[:4], 3000, "ip")
    _check(Engine(items, device=device, options=path).rescore(users, lists, 3000), users, items, lists, 3000, "ip")


def test_large_k_beyond_the_kernel_falls_back(device, path):
    rng = np.random.default_rng(6)
    items, users = _ints(rng, 45_000, 4), _ints(rng, 3, 4)
    lists = [rng.integers(0, 45_000, 2500), np.arange(45_000), [1, 2]]
    k = 40_000  # more keys than a GPU thread block's shared memory holds: the GEMM path selects instead
    res = Engine(items, device=device, options=path).rescore(users, lists, k)
    _check(res, users, items, lists, k, "ip")


@pytest.mark.parametrize("dim", [1, 3, 5, 64, 68, 130])
def test_dimensions(device, dim):
    """The GPU kernel reads rows as float4 when dim % 4 == 0, else as floats, with a lane count per dim."""
    rng = np.random.default_rng(dim)
    items, users = _ints(rng, 200, dim), _ints(rng, 10, dim)
    lists = _lists(rng, 10, 200, 60)
    _check(Engine(items, device=device).rescore(users, lists, 9), users, items, lists, 9, "ip")


def test_ids_and_arrow(device):
    rng = np.random.default_rng(7)
    items, users = _ints(rng, 10, 4), _ints(rng, 2, 4)
    ids = np.array([f"item{i}" for i in range(10)], dtype=object)
    res = Engine(items, ids=ids, device=device).rescore(users, [[3, 4], []], 3)
    rows = as_numpy(res.indices)
    assert res.ids[0, 0] == f"item{rows[0, 0]}" and res.ids[1, 0] is None
    table = res.to_arrow(np.array([10, 11]))
    assert table.column("item_ids").to_pylist()[1] == [] and len(table.column("item_ids").to_pylist()[0]) == 2


@settings(max_examples=25)
@given(data=st.data())
def test_property_equals_oracle(device, data):
    n_items = data.draw(st.integers(1, 40))
    n_users = data.draw(st.integers(0, 6))
    dim = data.draw(st.integers(1, 6))
    k = data.draw(st.integers(1, 12))
    seed = data.draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    items, users = _ints(rng, n_items, dim, -1, 1), _ints(rng, n_users, dim, -1, 1)
    lists = [rng.integers(0, n_items, int(rng.integers(0, 30))) for _ in range(n_users)]
    res = Engine(items, metric=data.draw(st.sampled_from(["ip", "l2"])), device=device)
    _check(res.rescore(users, lists, k), users, items, lists, k, res.metric)


# ---- bad input -------------------------------------------------------------------------------------------------

def test_bad_candidates_name_user_and_row(device):
    rng = np.random.default_rng(8)
    items, users = _ints(rng, 10, 4), _ints(rng, 3, 4)
    engine = Engine(items, device=device)
    with pytest.raises(InputError, match=r"user row 1 has item row 10 at position 2 of its list, out of range for "
                                         r"10 items"):
        engine.rescore(users, [[1], [0, 1, 10], []], 2)
    with pytest.raises(InputError, match="user row 2 has item row -1"):
        engine.rescore(users, _csr([[1], [2], [-1]]), 2)
    with pytest.raises(InputError, match="got 2 lists for 3 users"):
        engine.rescore(users, [[1], [2]], 2)
    with pytest.raises(InputError, match="indptr has 3 entries, expected n_users \\+ 1 = 4"):
        engine.rescore(users, (np.array([0, 1, 2]), np.array([1, 2])), 2)
    with pytest.raises(InputError, match="indptr must start at 0"):
        engine.rescore(users, (np.array([0, 2, 1, 3]), np.array([1, 2, 3])), 2)
    with pytest.raises(InputError, match="must be integer item rows"):
        engine.rescore(users, [[1.5], [], []], 2)
    with pytest.raises(InputError, match="matrix of 2 rows for 3 users"):
        engine.rescore(users, np.zeros((2, 4), np.int64), 2)
    with pytest.raises(InputError, match="CSR pair"):
        engine.rescore(users, 7, 2)
    for k in (0, -1, 2.5, True):
        with pytest.raises(InputError, match="k must be an integer"):
            engine.rescore(users, [[1], [], []], k)
    with pytest.raises(InputError, match="dimension 5 does not match"):
        engine.rescore(np.ones((3, 5), np.float32), [[1], [], []], 2)
    bad = users.copy()
    bad[1, 2] = np.nan
    with pytest.raises(InputError, match="row 1 has a NaN"):
        engine.rescore(bad, [[1], [], []], 2)


def test_bad_path_is_refused():
    with pytest.raises(InputError, match="rescore path 'fast'"):
        EngineOptions(rescore="fast")


# ---- helpers ----------------------------------------------------------------------------------------------------

def test_lanes_cover_a_row_in_one_round():
    # Each lane loads two 16-byte pieces of the row: dim 64 (16 float4) takes 8 lanes, and every load is in flight
    # before the first use wherever 32 lanes suffice.
    assert lanes(64) == 8 and lanes(128) == 16 and lanes(256) == 32 and lanes(68) == 16
    for dim in range(1, 300):
        g = lanes(dim)
        chunks = dim // 4 if dim % 4 == 0 else dim
        assert g in (1, 2, 4, 8, 16, 32) and (2 * g >= chunks or g == 32)


def test_ordered_sums_of_float4_rows_reserve_each_warps_stage(monkeypatch):
    # rescore.cu's layout: ordered sums stage 32 rows' pieces of 32 columns (a row every 36 floats for float4 rows,
    # 33 for float rows) per warp of the 128-thread block, between the control words and the user's vector; nothing
    # else does. The duplicate flags (SZ bytes) then take the stage's room: the select and the gather never use it
    # at once.
    stage = 4 * 32 * 36 * 4
    assert smem_bytes(256, 64, ordered=True) - smem_bytes(256, 64) == stage - 256
    assert smem_bytes(256, 37, ordered=True) - smem_bytes(256, 37) == stage - 256  # rows read as floats: staged too
    assert smem_bytes(256, 0) == 8 * 262 + 4 * 256 + 4 * 256 + 256  # precomputed scores: no rows, no stage
    k_pad, sz, smem = launch_config(100, 64, 130, ordered=True)  # under the 48 KiB every device has
    assert (k_pad, sz) == (128, 160) and smem == smem_bytes(160, 64) + stage - 160
    # k = 8,192 (SZ 16,384 keys) fits in a Hopper block's 227 KiB with the stage, up to 256 dimensions; a stage
    # smaller than the flags grows to hold them.
    assert smem_bytes(16384, 256, True, 8192) <= 227 * 1024 < smem_bytes(16384, 256, k_pad=8192) + stage
    assert smem_bytes(32768, 64, True, 16384) - smem_bytes(32768, 64, k_pad=16384) == 0
    # Selected keys that fit in the stage (8 K_pad bytes: K_pad up to 2,048) take it, and the flags the scratch: the
    # scratch then holds 4 SZ bytes (or the flags' if more), not 8 K_pad.
    for sz, k_pad in ((2144, 2048), (256, 128), (320, 1024), (4096, 2048)):
        assert smem_bytes(sz, 64, True, k_pad) == 8 * (sz + 6) + stage + 256 + max(4 * sz, max(sz, k_pad)) + 1024
    assert smem_bytes(4096, 64, True, 4096) == 8 * (4096 + 6) + stage + 256 + 8 * 4096 + 1024
    # Lists that all fit in the chunked layout's keys take one chunk of the longest rounded up to SZ_STEP (the
    # selected keys may then outgrow the rows' scratch): at k = 2,048 (lists of 2,113: 2,144 keys, the selected ones
    # in the stage) five blocks an SM on a Hopper, where 2,176 keys would allow four and 4,096 three; at k = 3,000
    # two instead of one; longer lists keep chunks of a power of two >= 2 K_pad.
    monkeypatch.setattr(rescore, "_max_smem", lambda: 227 * 1024)  # a Hopper block's (no device here to ask)
    per_sm = 228 * 1024
    k_pad, sz, smem = launch_config(2048, 64, 2113, ordered=True)
    assert (k_pad, sz) == (2048, 2144) and smem == smem_bytes(2144, 64, ordered=True, k_pad=2048) == 45_488
    assert 5 * (smem + 1024) <= per_sm < 5 * (smem_bytes(2176, 64, ordered=True, k_pad=2048) + 1024)
    assert 3 * (smem_bytes(4096, 64, ordered=True, k_pad=2048) + 1024) <= per_sm
    k_pad, sz, smem = launch_config(3000, 64, 3751, ordered=True)
    assert (k_pad, sz) == (4096, 3776) and smem == smem_bytes(8192, 64, True, 4096) - 8 * (8192 - 3776)
    assert 2 * (smem + 1024) <= per_sm
    assert launch_config(3000, 64, 8192, ordered=True)[:2] == (4096, 8192)
    assert launch_config(3000, 64, 8193, ordered=True)[:2] == (4096, 8192)  # two chunks and more
    assert launch_config(2048, 64, 2048, ordered=True)[:2] == (2048, 2048)
    assert launch_config(1000, 64, 300, ordered=True)[:2] == (1024, 320)  # fewer keys than K_pad: one chunk
    assert launch_config(100, 64, 5000, ordered=True)[:2] == (128, 4096)  # chunks of _SZ_TARGET
    # The duplicate flags cover the K_pad selected keys where SZ is smaller.
    assert smem_bytes(384, 0, k_pad=1024) - smem_bytes(384, 0, k_pad=384) == 8 * (1024 - 384) + (1024 - 384)


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 8192), longest=st.integers(0, 40_000), dim=st.sampled_from([0, 3, 64, 256]),
       ordered=st.booleans())
def test_launch_config_holds_every_list(monkeypatch, k, longest, dim, ordered):
    # One chunk of the longest list rounded up to SZ_STEP where that is no more than the chunked layout's keys (a
    # power of two, at least 2 K_pad, so that the best so far sit beside each next chunk); the shared memory is what
    # smem_bytes says, and within the device's.
    monkeypatch.setattr(rescore, "_max_smem", lambda: 227 * 1024)
    cfg = launch_config(k, dim, longest, ordered)
    k_pad = 1 << max(0, (k - 1).bit_length())
    chunked = max(2 * k_pad, min(1 << max(0, (max(longest, 1) - 1).bit_length()), 4096))
    whole = -(-max(longest, 1) // rescore.SZ_STEP) * rescore.SZ_STEP
    sz = min(whole, chunked)
    if cfg is None:
        assert smem_bytes(sz, dim, ordered, k_pad) > 227 * 1024
        return
    assert cfg == (k_pad, sz, smem_bytes(sz, dim, ordered, k_pad)) and cfg[2] <= 227 * 1024
    assert sz >= longest or (sz & (sz - 1) == 0 and sz >= 2 * k_pad)  # one chunk, or chunks beside the best K_pad
    assert sz % 2 == 0  # the stage after the keys stays 16-byte aligned


def test_short_lists_take_a_warp_a_user():
    # The certified route and fast mode re-score k + m + 1 candidates a user: 126 at k = 100, a warp a user; longer
    # lists and larger k keep the block kernel.
    assert takes_warp(100, 126, 64) and takes_warp(128, 128, 257) and takes_warp(1, 1, 1)
    assert not takes_warp(129, 129, 64) and not takes_warp(100, 129, 64)
    assert not takes_warp(100, 126, 0)  # precomputed scores (select): no vectors to sum
    # Four warps' keys, stages, vectors and rows: 28,736 bytes at d = 257; past the 48 KiB every device has, the block.
    assert warp_smem_bytes(257) == 4 * (8 * 128 + 4 * 32 * 36 + 4 * 260 + 4 * 128) == 28_736
    assert warp_smem_bytes(1536) <= 48 * 1024 < warp_smem_bytes(1540) and not takes_warp(100, 126, 1540)


def test_wgmma_kernels_keep_two_blocks_an_sm():
    # fused_w.cu's shared memory (the users' tile, the item tiles in flight, each user's stage of survivors and its
    # count) stays within half of an H100/H200 SM's 228 KiB, less the 1 KiB the device reserves a block, at every
    # width it is built for; the stage holds at least 4 keys a user, and as many as fit where the rows are narrow
    # (a key fewer a user would leave room for another: no stage narrower than it could be, up to 80 columns).
    from recall.backends.cupy.fused import wgmma_smem, wgmma_staged

    for padded in range(16, 145, 16):
        tiles = 2 * 128 * padded * (1 + (2 if padded > 96 else 3))
        assert 2 * (wgmma_smem(padded) + 1024) <= 228 * 1024, padded
        assert wgmma_smem(padded) - tiles == 128 * (8 * wgmma_staged(padded) + 4), padded
        assert wgmma_staged(padded) >= 4, padded
        if padded <= 80:
            assert 2 * (wgmma_smem(padded) + 128 * 8 + 1024) > 228 * 1024, padded
    assert [wgmma_staged(p) for p in (16, 32, 48, 64, 80)] == [96, 80, 64, 48, 32]


# ---- files and the CLI -------------------------------------------------------------------------------------------

runner = CliRunner()


@pytest.fixture
def files(tmp_path: Path) -> dict:
    rng = np.random.default_rng(9)
    items, users = _ints(rng, 30, 4), _ints(rng, 12, 4)
    user_ids, item_ids = 100 + np.arange(12), 7000 + np.arange(30)[::-1]
    cands = pa.table({
        "user_id": pa.array([105, 101, 999, 105, 103, 110], pa.int64()),
        "item_ids": pa.array([[7000, 7001, 7001, 12], [7029, 7028, 7027], [7000], [7003], [], [7010]],
                             pa.list_(pa.int64())),
    })
    pq.write_table(cands, tmp_path / "c.parquet")
    return {
        "users": write_embeddings(tmp_path / "users.parquet", user_ids, users, "list32", row_group_size=5),
        "items": write_embeddings(tmp_path / "items.parquet", item_ids, items, row_group_size=7),
        "cands": tmp_path / "c.parquet", "out": tmp_path / "out.parquet", "dir": tmp_path,
        "user_vecs": users, "item_vecs": items, "user_ids": user_ids, "item_ids": item_ids,
    }


def _args(f: dict, *extra: str, k: str = "2") -> list[str]:
    return ["rescore", "--users", str(f["users"]), "--items", str(f["items"]), "--candidates", str(f["cands"]),
            "--k", k, "--out", str(f["out"]), "--device", "cpu", *extra]


def _candidates(files: dict) -> tuple[np.ndarray, "object"]:
    pairs = read_pairs(files["cands"], files["user_ids"], files["item_ids"], what="candidate", sort_unique=False)
    present = np.flatnonzero(pairs.named)
    return present, pairs, pairs.take(present)


def test_read_candidates_maps_ids_and_counts_unknown(files):
    present, pairs, c = _candidates(files)
    row = {int(i): r for r, i in enumerate(files["item_ids"])}
    assert present.tolist() == [1, 3, 5, 10]  # users-file order; user 103 named with an empty list
    assert c.indptr.tolist() == [0, 3, 3, 7, 8]
    assert c.item_rows.tolist() == [row[7029], row[7028], row[7027], row[7000], row[7001], row[7001], row[7003],
                                    row[7010]]
    assert (pairs.n_pairs, pairs.n_unknown) == (10, 2)  # item 12 and user 999


@pytest.mark.parametrize("metric", METRICS)
def test_cli_rescore(files, metric):
    result = runner.invoke(app, _args(files, "--metric", metric, k="3"))
    assert result.exit_code == 0, result.output
    assert "warning: 2 of 10 candidates name a user or item id that is not in the input files" in result.stderr
    line = result.stdout.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("rescored 4 users x 8 candidate pairs (of 30 items), dim 4, k 3")
    table = pq.read_table(files["out"])
    assert table.column("user_id").to_pylist() == [101, 103, 105, 110]
    present, _, c = _candidates(files)
    lists = [c.item_rows[c.indptr[i]:c.indptr[i + 1]] for i in range(4)]
    want_idx, want_val = _want(files["user_vecs"][present], files["item_vecs"], lists, 3, metric)
    got = table.column("item_ids").to_pylist()
    scores = table.column("scores").to_pylist()
    for i in range(4):
        keep = want_idx[i] >= 0
        if metric != "cosine":
            assert got[i] == files["item_ids"][want_idx[i][keep]].tolist()
        np.testing.assert_allclose(scores[i], want_val[i][keep], rtol=1e-5, atol=1e-6)
    assert got[1] == []  # a user named with an empty list keeps its row


def test_cli_pairs_form_and_string_ids(tmp_path):
    rng = np.random.default_rng(10)
    items, users = _ints(rng, 6, 3), _ints(rng, 2, 3)
    write_embeddings(tmp_path / "u.parquet", ["a", "b"], users)
    write_embeddings(tmp_path / "i.parquet", [f"i{j}" for j in range(6)], items)
    pq.write_table(pa.table({"user_id": ["b", "b", "a", "b"], "item_id": ["i1", "i2", "i5", "i1"]}),
                   tmp_path / "c.parquet")
    result = runner.invoke(app, ["rescore", "--users", str(tmp_path / "u.parquet"), "--items",
                                 str(tmp_path / "i.parquet"), "--candidates", str(tmp_path / "c.parquet"), "--k",
                                 "5", "--out", str(tmp_path / "o.parquet"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    table = pq.read_table(tmp_path / "o.parquet").to_pylist()
    assert [r["user_id"] for r in table] == ["a", "b"]
    assert table[0]["item_ids"] == ["i5"] and sorted(table[1]["item_ids"]) == ["i1", "i2"]


def test_cli_bad_inputs_exit_2_with_one_line(files):
    cases = [
        (["--k", "0"], "k must be an integer >= 1"),
        (["--candidates", str(files["dir"] / "nope.parquet")], "no such file"),
        (["--candidates", str(files["users"])], "candidate columns are"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
        (["--memory-budget", "lots"], "--memory-budget must be a positive number"),
    ]
    for extra, message in cases:
        args = _args(files)
        for opt, value in zip(extra[::2], extra[1::2]):
            if opt in args:
                args[args.index(opt) + 1] = value
            else:
                args += [opt, value]
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (extra, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (extra, lines)
        assert "Traceback" not in result.output
        assert not files["out"].exists()


def test_cli_mismatched_id_types_and_nulls(files):
    pq.write_table(pa.table({"user_id": ["x"], "item_ids": [["7000"]]}), files["cands"])
    result = runner.invoke(app, _args(files))
    assert result.exit_code == 2 and "column 'user_id' has type string, but the users' ids are integers" in \
        result.stderr
    pq.write_table(pa.table({"user_id": pa.array([101, None], pa.int64()),
                             "item_ids": pa.array([[7000], [7001]], pa.list_(pa.int64()))}), files["cands"])
    result = runner.invoke(app, _args(files))
    assert result.exit_code == 2 and "row 1 has a null user_id" in result.stderr
    pq.write_table(pa.table({"user_id": pa.array([101, 102], pa.int64()),
                             "item_ids": pa.array([[7000], [7001, None]], pa.list_(pa.int64()))}), files["cands"])
    result = runner.invoke(app, _args(files))
    assert result.exit_code == 2 and "row 1 has a null inside its item_ids list" in result.stderr
    assert not files["out"].exists()


def test_cli_failure_keeps_previous_output(files):
    files["out"].write_bytes(b"previous")
    pq.write_table(pa.table({"user_id": ["x"], "item_ids": [["7000"]]}), files["cands"])
    assert runner.invoke(app, _args(files)).exit_code == 2
    assert files["out"].read_bytes() == b"previous"
    assert [p.name for p in files["dir"].iterdir() if p.name.startswith(".out")] == []


# ---- the S5 bench workload -------------------------------------------------------------------------------------

def test_bench_candidate_workload_truth_and_check():
    import dataclasses

    from recall.bench import contenders, oracle as bench_oracle, workloads

    w = dataclasses.replace(workloads.get("S5-small"), n_users=150, n_items=2000, candidates=120, k=10)
    rows = workloads.candidate_rows(150, 2000, 120, seed=1)
    assert rows.shape == (150, 120) and rows.dtype == np.int64 and rows.min() >= 0 and rows.max() < 2000
    assert all(np.unique(r).size == 120 for r in rows)  # distinct within a user
    users, items = w.generate(seed=2)
    assert isinstance(users, workloads.CandidateUsers) and users.shape == (150, 32)
    sample = bench_oracle.sample_rows(150, 60, 0)
    for metric in METRICS:
        truth = w.truth(users, items, sample, metric)
        c = contenders.RecallContender("cpu", metric)
        assert c.unsupported_workload(w) is None
        c.prepare(items)
        idx, sc = c.search(users, w.k)
        check = w.check(truth, users, items, idx, sc, rtol=1e-4)
        assert check.exact and check.invalid == 0 and check.max_score_error < 1e-5
        # An item outside a user's candidates never counts, even if it would score well.
        bad = np.array(idx, copy=True)
        outside = np.setdiff1d(np.arange(2000), users.candidates[sample[0]])[0]
        bad[sample[0], 0] = outside
        assert w.check(truth, users, items, bad, None, rtol=1e-4).users_short == 1
    assert contenders.FaissContender("cpu").unsupported_workload(w)
    assert contenders.RecallContender("cpu", "ip", "fast").unsupported_workload(w)
    assert w.bytes_moved == 150 * (120 * 32 * 4 + 10 * 12)


# ---- GPU only: device arrays in place, both paths, equal to the CPU bit for bit ---------------------------------

@pytest.mark.gpu
def test_gpu_device_arrays_in_place_equal_cpu(path):
    import cupy

    rng = np.random.default_rng(11)
    items, users = _ints(rng, 5000, 20, -3, 3), _ints(rng, 300, 20, -3, 3)
    lists = _lists(rng, 300, 5000, 900)
    indptr, rows = _csr(lists)
    want = Engine(items, device="cpu", options=path).rescore(users, lists, 50)
    gpu = Engine(cupy.asarray(items), device="gpu", options=path)
    got = gpu.rescore(cupy.asarray(users), (indptr, cupy.asarray(rows)), 50)
    assert isinstance(got.indices, cupy.ndarray) and isinstance(got.scores, cupy.ndarray)
    assert gpu.stats["rescore_path"] == path.rescore
    np.testing.assert_array_equal(as_numpy(got.indices), want.indices)
    np.testing.assert_array_equal(as_numpy(got.scores), want.scores)
    matrix = rng.integers(0, 5000, (300, 64))
    got = gpu.rescore(cupy.asarray(users), cupy.asarray(matrix), 7)
    want = Engine(items, device="cpu", options=path).rescore(users, matrix, 7)
    np.testing.assert_array_equal(as_numpy(got.indices), want.indices)
    np.testing.assert_array_equal(as_numpy(got.scores), want.scores)
    # k = 1,000 over lists of up to 1,450 rows with repeats: one chunk of 1,536 keys, not a power of two
    # (rescore.launch_config), sorted the long way at any length; lists of up to 700: fewer keys than K_pad.
    for longest in (1450, 700):
        lists = _lists(rng, 300, 5000, longest)
        indptr, rows = _csr(lists)
        want = Engine(items, device="cpu", options=path).rescore(users, lists, 1000)
        got = gpu.rescore(cupy.asarray(users), (indptr, cupy.asarray(rows)), 1000)
        np.testing.assert_array_equal(as_numpy(got.indices), want.indices)
        np.testing.assert_array_equal(as_numpy(got.scores), want.scores)


def test_rescore_job_refuses_candidates_that_name_nothing_it_knows(files):
    """Every pair unknown (another catalogue's ids): every user would get an empty list, and yesterday's output would
    be replaced by nothing. Refused, the output as it was."""
    files["out"].write_bytes(b"yesterday")
    pq.write_table(pa.table({"user_id": pa.array([1, 2], pa.int64()), "item_id": pa.array([5, 6], pa.int64())}),
                   files["dir"] / "other.parquet")
    result = runner.invoke(app, ["rescore", "--users", str(files["users"]), "--items", str(files["items"]),
                                 "--candidates", str(files["dir"] / "other.parquet"), "--k", "3",
                                 "--out", str(files["out"]), "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "no candidate pair names a user of the users file and an item of the items file (2 pairs, all unknown)" \
        in " ".join(result.stderr.split())
    assert files["out"].read_bytes() == b"yesterday"


def test_rescore_job_names_the_file_row_of_a_zero_user_under_cosine(files):
    # The users named by candidates are a subset (rows 1, 3, 5, 10): the message names the file's row, not the
    # position among them.
    users = files["user_vecs"].copy()
    users[5] = 0
    write_embeddings(files["users"], files["user_ids"], users, "list32", row_group_size=5)
    with pytest.raises(InputError, match=r"users\.parquet: row 5 \(id 105\) is a zero vector"):
        rescore_files(files["users"], files["items"], files["cands"], files["out"], 3, metric="cosine", device="cpu")
