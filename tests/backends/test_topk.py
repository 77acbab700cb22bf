"""The CPU running top-k kernels, called directly: ``heap_update`` over multi-tile score batches and
``heap_sort_rows``. Arrays keep the dtypes and layouts the backend passes (C-contiguous float32 / int64), so numba
compiles (or loads from its cache) one signature per kernel."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from recall.backends.numpy import heap as topk


def _empty_heaps(n_users: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return topk.new_heaps(n_users, k)


def _sorted(heap_keys: np.ndarray, heap_thr: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    out_vals = np.empty(heap_keys.shape, np.float32)
    out_idx = np.empty(heap_keys.shape, np.int64)
    topk.heap_sort_rows(heap_keys, out_vals, out_idx)
    return out_vals, out_idx


def _csr(sets: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, unique CSR (the form ``recall.exclusions.normalise`` guarantees)."""
    indptr = np.zeros(len(sets) + 1, np.int64)
    rows = []
    for u, s in enumerate(sets):
        s = sorted(set(s))
        rows.extend(s)
        indptr[u + 1] = indptr[u] + len(s)
    return indptr, np.array(rows, dtype=np.int64)


def _run(full: np.ndarray, k: int, width: int, tiles_per_call: int, n_items: int, excl=None, kind: str = "heap"
         ) -> tuple[np.ndarray, np.ndarray]:
    """Feed ``full`` (n_users, n_cols >= n_items) to the selection kernel of ``kind`` ("heap": heap_update,
    "buffer": buffer_update, cut back to k whenever 2k keys are held) in calls of ``tiles_per_call`` tiles of
    ``width`` columns, in item order, with item rows >= n_items present in the last tile but to be ignored."""
    n_users, n_cols = full.shape
    if kind == "heap":
        heap_keys, heap_thr = _empty_heaps(n_users, k)
    else:
        heap_keys, heap_thr, counts = topk.new_buffers(n_users, k)
    indptr, rows = excl if excl is not None else _csr([[] for _ in range(n_users)])
    span = width * tiles_per_call
    for start in range(0, n_cols, span):
        chunk = full[:, start:start + span]
        tiles = -(-chunk.shape[1] // width)
        padded = np.full((n_users, tiles * width), np.float32(1e30), np.float32)  # would win if not cut off
        padded[:, : chunk.shape[1]] = chunk
        batch = np.ascontiguousarray(padded.reshape(n_users, tiles, width).transpose(1, 0, 2))
        if kind == "heap":
            topk.heap_update(batch, start, n_items, heap_keys, heap_thr, indptr, rows)
        else:
            topk.buffer_update(batch, start, n_items, heap_keys, counts, heap_thr, k, indptr, rows)
    if kind == "heap":
        vals, idx = _sorted(heap_keys)
        # Each threshold is the user's k-th best score so far (-inf while it holds fewer than k).
        np.testing.assert_array_equal(heap_thr, vals[:, -1])
        return vals, idx
    vals = np.empty((n_users, k), np.float32)
    idx = np.empty((n_users, k), np.int64)
    topk.buffer_sort_rows(heap_keys, counts, vals, idx)
    # A buffer's threshold trails: at most the k-th best score so far, and exactly it after a cut.
    assert np.all(heap_thr <= vals[:, -1]) and np.all(counts < 2 * k)
    return vals, idx


KINDS = pytest.mark.parametrize("kind", ["heap", "buffer"])


def _assert_matches(vals, idx, full, k, n_items, exclude=None):
    want_idx, want_val = oracle.topk_from_scores(full[:, :n_items], k, exclude)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(vals, want_val.astype(np.float32))


def test_multi_tile_batch_with_cutoff_inside_last_tile():
    rng = np.random.default_rng(0)
    n_users, width, n_tiles, k = 5, 16, 4, 7
    n_items = 3 * width + 5  # the cut falls 5 rows into the last tile
    full = rng.standard_normal((n_users, n_tiles * width)).astype(np.float32)
    full[:, n_items:] = 1e30  # rows past n_items must never be taken, however good
    batch = np.ascontiguousarray(full.reshape(n_users, n_tiles, width).transpose(1, 0, 2))
    heap_keys, heap_thr = _empty_heaps(n_users, k)
    indptr, rows = _csr([[] for _ in range(n_users)])
    topk.heap_update(batch, 0, n_items, heap_keys, heap_thr, indptr, rows)
    vals, idx = _sorted(heap_keys)
    assert idx.max() < n_items
    _assert_matches(vals, idx, full, k, n_items)


def test_tile_layout_is_tiles_users_width():
    # scores[b, u, t] is user u against item b*width + t: a distinct best item per user in different tiles.
    n_users, width, n_tiles = 3, 4, 3
    batch = np.zeros((n_tiles, n_users, width), np.float32)
    batch[2, 0, 1] = 5.0  # user 0 -> item 9
    batch[0, 1, 3] = 5.0  # user 1 -> item 3
    batch[1, 2, 0] = 5.0  # user 2 -> item 4
    heap_keys, heap_thr = _empty_heaps(n_users, 1)
    indptr, rows = _csr([[], [], []])
    topk.heap_update(batch, 100, 10_000, heap_keys, heap_thr, indptr, rows)
    vals, idx = _sorted(heap_keys)
    np.testing.assert_array_equal(idx[:, 0], [109, 103, 104])
    np.testing.assert_array_equal(vals[:, 0], 5.0)


@pytest.mark.parametrize("width, tiles_per_call", [(1, 1), (3, 2), (64, 1), (65, 3), (200, 1)])
@KINDS
def test_successive_calls_ties_and_exclusions(width, tiles_per_call, kind):
    # Integer scores with many ties across call and tile boundaries, some exclusions before, inside and after
    # each call's range, and a cutoff in the last tile.
    rng = np.random.default_rng(width)
    n_users, n_cols, k = 6, 203, 9
    n_items = 197
    full = rng.integers(-3, 4, (n_users, n_cols)).astype(np.float32)
    sets = [rng.choice(n_items, size=rng.integers(0, 60), replace=False).tolist() for _ in range(n_users)]
    sets[0] = list(range(0, n_items, 2))
    sets[3] = list(range(n_items - 1))  # only the last item remains for user 3
    excl = _csr(sets)
    vals, idx = _run(full, k, width, tiles_per_call, n_items, excl, kind=kind)
    _assert_matches(vals, idx, full, k, n_items, excl)
    assert (idx[3] >= 0).sum() == 1 and idx[3, 0] == n_items - 1


@KINDS
def test_equal_score_never_displaces_lower_row(kind):
    # All scores equal: the first k rows must be kept, in row order, whatever the tiling.
    full = np.zeros((2, 300), np.float32)
    for width in (1, 7, 64, 300):
        vals, idx = _run(full, 10, width, 2, 300, kind=kind)
        np.testing.assert_array_equal(idx, np.tile(np.arange(10), (2, 1)))
        np.testing.assert_array_equal(vals, 0.0)


@KINDS
def test_rising_scores_every_tile_beats_the_last(kind):
    # The threshold filter's worst case: every item beats all earlier ones.
    full = np.tile(np.arange(1000, dtype=np.float32), (3, 1))
    full[1] = -full[1]  # and a falling user for contrast
    vals, idx = _run(full, 25, 64, 1, 1000, kind=kind)
    np.testing.assert_array_equal(idx[0], np.arange(999, 974, -1))
    np.testing.assert_array_equal(idx[1], np.arange(25))
    _assert_matches(vals, idx, full, 25, 1000)


@KINDS
def test_k_larger_than_items_pads_at_the_end(kind):
    full = np.array([[1.0, 3.0, 2.0], [0.0, 0.0, -1.0]], np.float32)
    vals, idx = _run(full, 5, 2, 1, 3, kind=kind)
    np.testing.assert_array_equal(idx, [[1, 2, 0, -1, -1], [0, 1, 2, -1, -1]])
    np.testing.assert_array_equal(vals[:, 3:], -np.inf)


@KINDS
def test_negative_and_huge_scores(kind):
    full = np.array([[-1e30, -3e38, 3e38, -5.0, np.float32(-1e-45)]], np.float32)
    vals, idx = _run(full, 5, 2, 2, 5, kind=kind)
    np.testing.assert_array_equal(idx, [[2, 4, 3, 0, 1]])


def test_heap_sort_rows_orders_any_arrangement():
    # heap_sort_rows needs no heap property: any arrangement, padding anywhere, comes out (score desc, row asc)
    # with padding last.
    vals = np.array([[1.0, -np.inf, 3.0, 1.0, 2.0, -np.inf],
                     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                     [-np.inf] * 6], np.float32)
    idx = np.array([[9, -1, 4, 2, 7, -1],
                    [5, 3, 8, 0, 1, 2],
                    [-1] * 6], np.int64)
    out_vals, out_idx = _sorted(topk.keys_of(vals, idx))
    np.testing.assert_array_equal(out_idx, [[4, 7, 2, 9, -1, -1], [0, 1, 2, 3, 5, 8], [-1] * 6])
    np.testing.assert_array_equal(out_vals[0], [3.0, 2.0, 1.0, 1.0, -np.inf, -np.inf])
    assert np.all(np.isneginf(out_vals[2]))


@KINDS
def test_signed_zeros_are_one_score_and_rows_order_them(kind):
    # -0.0 == +0.0: row order decides between them, as for any equal scores (the key of -0.0 is that of +0.0).
    full = np.array([[-0.0, 0.0, -0.0, -1.0, 0.0]], np.float32)
    vals, idx = _run(full, 4, 2, 1, 5, kind=kind)
    np.testing.assert_array_equal(idx, [[0, 1, 2, 4]])
    np.testing.assert_array_equal(vals, [[0.0, 0.0, 0.0, 0.0]])


def test_keys_order_as_score_desc_row_asc():
    # One integer comparison of keys is the (score, row) order, across signs, magnitudes, infinities and rows
    # up to the largest a key holds.
    vals = np.array([np.inf, 3e38, 1.0, 1.0, 1e-45, 0.0, -1e-45, -1.0, -3e38, -np.inf, -np.inf], np.float32)
    rows = np.array([0, 5, 2, topk.MAX_ROWS, 7, 1, 9, 0, 4, 3, -1])
    keys = topk.keys_of(vals, rows)
    assert np.all(keys[:-1] > keys[1:])  # best first, the empty slot last
    assert keys[-1] == topk.EMPTY_KEY


def test_cpu_backend_refuses_rows_a_key_cannot_hold():
    from recall.backends.numpy.backend import NumpyBackend
    from recall.core.errors import ResourceError

    with pytest.raises(ResourceError, match="at most 4,294,967,295 items"):
        NumpyBackend().run_blocks(None, None, None, topk.MAX_ROWS + 2, 10, None, None, None, None)


def test_topk_rows_reference():
    scores = np.array([[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, 2.0, 2.0]], np.float32)
    vals, cols = topk.topk_rows(scores, 3)
    np.testing.assert_array_equal(cols, [[1, 2, 0], [0, 1, 2]])
    np.testing.assert_array_equal(vals, [[5.0, 5.0, 1.0], [2.0, 2.0, 2.0]])
    assert cols.dtype == np.int64
    vals, cols = topk.topk_rows(scores, 9)
    assert cols.shape == (2, 4)


@st.composite
def _heap_problems(draw):
    n_users = draw(st.integers(1, 6))
    width = draw(st.integers(1, 40))
    tiles_per_call = draw(st.integers(1, 4))
    n_cols = draw(st.integers(1, 160))
    n_items = draw(st.integers(max(1, n_cols - width + 1), n_cols))  # the cut inside the last tile
    k = draw(st.integers(1, 50))
    integer = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if integer:
        full = rng.integers(-2, 3, (n_users, n_cols)).astype(np.float32)
    else:
        full = rng.standard_normal((n_users, n_cols)).astype(np.float32)
    sets = [draw(st.lists(st.integers(0, n_items - 1), max_size=n_items)) for _ in range(n_users)]
    return full, k, width, tiles_per_call, n_items, _csr(sets)


@given(problem=_heap_problems())
@settings(max_examples=150)
@KINDS
def test_property_heap_matches_stable_argsort(problem, kind):
    full, k, width, tiles_per_call, n_items, excl = problem
    vals, idx = _run(full, k, width, tiles_per_call, n_items, excl, kind=kind)
    # float32 scores compared in float32: the kernel sees exactly these values, so even float data is exact.
    _assert_matches(vals, idx, full, k, n_items, excl)
    real = idx >= 0
    assert np.all(real[:, 1:] <= real[:, :-1])
    for row in idx:
        kept = row[row >= 0]
        assert np.unique(kept).size == kept.size


# ---- the float64 oracle itself: the reference must be right, and its checks must be able to fail ----------------

def test_oracle_by_hand():
    users = np.array([[1.0, 0.0], [0.0, 0.0]])
    items = np.array([[2.0, 0.0], [0.0, 5.0], [2.0, 1.0], [-1.0, 0.0]])
    idx, val = oracle.topk(users, items, 3)
    np.testing.assert_array_equal(idx, [[0, 2, 1], [0, 1, 2]])  # user 1: every score 0, row order
    np.testing.assert_array_equal(val, [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    idx, val = oracle.topk(users, items, 6, "l2", exclude={0: [0, 0]})  # k > n_items: as wide as the catalogue
    np.testing.assert_array_equal(idx, [[2, 3, 1, -1], [3, 0, 2, 1]])
    np.testing.assert_array_equal(val[0, :3], [-2.0, -4.0, -26.0])
    assert np.isneginf(val[0, 3])
    idx, _ = oracle.topk(np.array([[3.0, 4.0]]), np.array([[6.0, 8.0], [1.0, 0.0], [0.3, 0.4]]), 3, "cosine")
    np.testing.assert_array_equal(idx, [[0, 2, 1]])
    assert oracle.topk(np.zeros((0, 2)), items, 2)[0].shape == (0, 2)


def test_oracle_csr_and_dict_exclusions_agree():
    scores = np.arange(12, dtype=np.float64).reshape(2, 6)
    a = oracle.topk_from_scores(scores, 4, {1: [5, 4]})
    b = oracle.topk_from_scores(scores, 4, (np.array([0, 0, 2]), np.array([5, 4])))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[0], [[5, 4, 3, 2], [3, 2, 1, 0]])


def test_oracle_checks_can_fail():
    rng = np.random.default_rng(1)
    users = rng.standard_normal((6, 5))
    items = rng.standard_normal((40, 5))
    idx, val = oracle.topk(users, items, 5)
    oracle.assert_topk_close(idx, val.astype(np.float32), users, items, 5)
    assert oracle.recall_at_k(idx, users, items, 5) == 1.0
    wrong = idx.copy()
    wrong[2, 0] = oracle.topk(users, items, 40)[0][2, -1]  # the worst item in place of the best
    with pytest.raises(AssertionError):
        oracle.assert_topk_close(wrong, val, users, items, 5)
    assert oracle.recall_at_k(wrong, users, items, 5) == pytest.approx(29 / 30)
    dup = idx.copy()
    dup[0, 1] = dup[0, 0]
    with pytest.raises(AssertionError):
        oracle.assert_topk_close(dup, val, users, items, 5)
    assert oracle.recall_at_k(dup, users, items, 5) == pytest.approx(29 / 30)
    with pytest.raises(AssertionError):
        oracle.assert_topk_close(idx, val + 0.01, users, items, 5)
    with pytest.raises(AssertionError):  # an excluded item returned
        oracle.assert_topk_close(idx, val, users, items, 5, exclude={3: [int(idx[3, 4])]})


def test_oracle_recall_is_tie_aware():
    users = np.array([[1.0]])
    items = np.array([[1.0], [1.0], [1.0], [0.0]])
    # Any two of the three tied items are a correct top-2; the tie rule picks rows 0 and 1.
    assert oracle.recall_at_k(np.array([[2, 1]]), users, items, 2) == 1.0
    assert oracle.recall_at_k(np.array([[3, 1]]), users, items, 2) == 0.5
    assert oracle.recall_at_k(np.array([[0, -1]]), users, items, 2) == 0.5
    assert oracle.recall_at_k(np.array([[0, 1]]), users, items, 2, exclude={0: [0]}) == 0.5
    # assert_topk_close (for float data) accepts any order among tied scores; the exact tie order is what the
    # integer-data tests check, comparing indices exactly.
    oracle.assert_topk_close(np.array([[1, 0]]), np.array([[1.0, 1.0]]), users, items, 2)


def test_lowest_bit_of_every_mask_position():
    from numba import njit

    @njit
    def lowest(m):
        return topk.lowest_bit(m)

    for bit in range(64):
        for above in (0, (1 << 64) - (1 << bit)):  # the bit alone, and with every bit above it set
            mask = np.uint64((1 << bit) | (above & ((1 << 64) - 1)))
            assert lowest(mask) == bit
