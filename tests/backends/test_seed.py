"""The GPU's threshold-sample size (``recall.backends.cupy.selection.seed_size``) and which searches take the fused
path (``recall.backends.cupy.fused.applies``): pure rules, checked here without a GPU; the seeded searches themselves
are checked on the device (tests/backends/test_gpu.py, and the sample's selection below)."""
from __future__ import annotations

import numpy as np
import pytest

from recall.backends.cupy.selection import seed_size


@pytest.mark.parametrize("k, n_items, want", [
    (10, 0, 16384), (10, 4096, 4096), (10, 3000, 4096), (10, 8193, 16384), (10, 1_000_000, 16384), (10, 1, 1),
    (1000, 0, 32768), (1000, 20000, 32768), (1000, 9000, 16384), (5000, 0, 262144), (5000, 100_000, 131072)])
def test_fused_capacity_holds_every_item_of_a_small_catalogue(k, n_items, want):
    # A user's filters pass each item at most once a search: a buffer of the power of two at least the catalogue
    # never overflows, so a small catalogue's buffers are no larger (0: the catalogue not known, the rule's room).
    from recall.backends.cupy.selection import fused_capacity

    assert fused_capacity(k, n_items) == want
    assert fused_capacity(k, n_items) >= min(n_items or want, fused_capacity(k))


@pytest.mark.parametrize("n_items, k, capacity, want", [
    (1_000_000, 100, 32_768, 8_192),     # S1: the full sample (the estimate would not apply to half of it)
    (1_000_000, 2_048, 32_768, 16_384),  # large k: 32k items, capped by the score buffer, halved for the estimate
    (1_000_000, 8_192, 8_192, 0),        # the buffer cannot hold 4k sampled items
    (1_000_000, 8_192, 65_536, 32_768),  # k = 8,192 in 4 tiles of 16,384 (the GPU's preferred tiles): 8 k, halved
    (100_000, 100, 32_768, 8_192),       # 8 x 8,192 <= 100k: the full sample
    # Fewer than 8 x 8,192 items, k small for them (at most a 256th): the largest power of two at most a sixteenth of
    # them or 32 k, under 8,192 items at most an eighth of them up to 512 (SMALL_K_MIN_SAMPLE), where that holds 128
    # items (SMALL_K_LEAST_SAMPLE).
    (60_000, 100, 32_768, 2_048),
    (20_000, 10, 24_576, 1_024),
    (20_000, 50, 24_576, 1_024),
    (16_384, 10, 24_576, 1_024),
    (16_383, 10, 24_576, 512),
    (8_192, 10, 24_576, 512),
    (8_191, 10, 24_576, 512),            # a sixteenth is 511, an eighth 1,023
    (8_000, 10, 24_576, 512),
    (4_096, 10, 24_576, 512),            # an eighth
    (4_096, 1, 24_576, 512),
    (2_048, 5, 24_576, 256),
    (1_024, 1, 24_576, 128),
    (1_023, 1, 24_576, 0),               # an eighth is 127
    (4_096, 16, 24_576, 512),            # 32 k, an eighth of the catalogue
    (8_192, 32, 24_576, 1_024),          # 32 k
    (20_000, 78, 24_576, 2_048),
    # A catalogue of fewer than 8 samples where k is large for it: a power of two, at most a quarter of it; for a
    # search that may start at an estimate (these: not ``bound``) half that, where it still holds 4 k items; then
    # half again where that holds 2 k and the estimate applies (ESTIMATE_SAMPLE_SHARE).
    (100_000, 1_000, 32_768, 4_096),
    (65_536, 1_024, 32_768, 4_096),
    (100_000, 2_048, 32_768, 4_096),     # 4 k, then 2 k
    (100_000, 2_561, 32_768, 8_192),     # 8,192 < 4 k: not halved by the first rule; by the estimate's share
    (100_000, 4_000, 32_768, 8_192),
    (100_000, 5_000, 32_768, 0),         # 16,384 < 4 k
    (100_000, 1_000, 8_192, 4_096),      # capped by the buffer
    (100_000, 1_000, 4_096, 2_048),
    (20_000, 300, 24_576, 2_048),        # half of it: mu = 15.4 sampled items above the k-th, under 16
    (5_000, 1_000, 32_768, 0),
    (20_000, 37, 900, 900),              # small tiles (the tests' plans): the buffer's width
    (4_096, 66, 4_096, 512),             # an eighth of the catalogue
])
def test_sample_size(n_items, k, capacity, want):
    assert seed_size(n_items, k, capacity) == want
    assert seed_size(n_items, k, capacity, seeded=False) == 0


@pytest.mark.parametrize("n_items, k, capacity, want", [
    # A sample whose ranking sorts few of a user's best items first (``loose``: ip over items of close norms) is not
    # halved for a pass that may estimate where the pass would not estimate from the half (ranked: mu < 16).
    (4_096, 66, 4_096, 1_024),     # mu = 8.25 from the half of 1,024
    (4_096, 128, 4_096, 512),      # mu = 16 from the half: halved
    (8_192, 100, 8_192, 2_048),    # mu = 12.5
    (8_192, 200, 8_192, 1_024),    # mu = 25
    (100_000, 1_000, 32_768, 4_096),  # mu = 82: halved, then the estimate's share
    (20_000, 300, 24_576, 2_048),
    (4_096, 16, 4_096, 512),       # k small for the catalogue: its own rule
])
def test_a_loosely_ranked_sample_is_halved_only_where_the_pass_estimates_from_the_half(n_items, k, capacity, want):
    assert seed_size(n_items, k, capacity, loose=True) == want
    assert seed_size(n_items, k, capacity, loose=True) >= seed_size(n_items, k, capacity)
    assert seed_size(n_items, k, capacity, bound=True, loose=True) >= want


@pytest.mark.parametrize("n_items, k, capacity, want", [
    # A search that starts at the sample's k-th best (``bound``) doubles the small-catalogue sample where it holds
    # fewer than 16 k items, from a catalogue of at least 3 doubled samples.
    (100_000, 2_048, 32_768, 32_768),
    (100_000, 4_096, 32_768, 32_768),
    (130_000, 2_048, 32_768, 32_768),
    (50_000, 600, 32_768, 16_384),
    (100_000, 1_000, 32_768, 16_384),  # 16,384 >= 16 k already
    (65_536, 2_048, 32_768, 16_384),   # 65,536 < 6 x 16,384: not doubled
    (20_000, 300, 24_576, 4_096),      # 20,000 < 6 x 4,096
    (100_000, 2_048, 16_384, 16_384),  # no room for the doubled sample
    (100_000, 5_000, 32_768, 0),       # unseeded by the rule (16,384 < 4 k): not seeded either
    (60_000, 100, 32_768, 2_048),      # k small for the catalogue: as the rule is, not doubled
    (20_000, 10, 24_576, 1_024),
    (1_000_000, 2_048, 65_536, 65_536),  # a large catalogue: the rule as it is
])
def test_bound_sample_size(n_items, k, capacity, want):
    assert seed_size(n_items, k, capacity, bound=True) == want
    assert seed_size(n_items, k, capacity, bound=True, seeded=False) == 0
    assert seed_size(n_items, k, capacity, bound=True, requested=8192) == seed_size(n_items, k, capacity,
                                                                                   requested=8192)


@pytest.mark.parametrize("n_items, k, capacity, requested, want", [
    (100_000, 1_000, 32_768, 32_768, 32_768),  # a requested sample: from catalogues of at least twice it
    (60_000, 1_000, 32_768, 32_768, 0),
    (100_000, 1_000, 16_384, 32_768, 16_384),  # capped by the buffer
    (100_000, 1_000, 32_768, 2_048, 0),        # fewer than 4 k
])
def test_requested_sample_size(n_items, k, capacity, requested, want):
    assert seed_size(n_items, k, capacity, requested=requested) == want


@pytest.mark.parametrize("n_items, k, capacity", [
    (1_000_000, 100, 32_768), (1_000_000, 2_048, 32_768), (100_000, 1_000, 32_768), (100_000, 2_561, 32_768),
    (100_000, 1_000, 4_096), (20_000, 300, 24_576), (1_000_000, 8_192, 65_536), (65_536, 1_024, 32_768),
])
def test_estimate_sample_is_a_share_of_the_rule_where_the_estimate_applies(monkeypatch, n_items, k, capacity):
    from recall.backends.cupy import selection

    got = seed_size(n_items, k, capacity)
    monkeypatch.setattr(selection, "ESTIMATE_SAMPLE_SHARE", 1)
    whole = seed_size(n_items, k, capacity)
    assert seed_size(n_items, k, capacity, bound=True) >= whole  # a bound's sample is never halved for an estimate
    if got != whole:  # halved only where half still holds 2 k items and the estimate applies to it
        assert got == whole // 2 and got >= 2 * k
        assert selection.estimate_rank(k, got, n_items, ranked=True) > 0
    else:
        assert whole // 2 < 2 * k or selection.estimate_rank(k, whole // 2, n_items, ranked=True) == 0


def _independent_sample(n_items, size, norms, even_every=2):
    # The rule spelled out row by row: the evenly spread rows (every even_every-th of them; none at 0), then the
    # largest norms of the rest (lower row first).
    stride = n_items // size
    if norms is None:
        return [stride // 2 + j * stride for j in range(size)]
    spread = [stride // 2 + j * stride for j in range(size) if even_every and j % even_every == 0]
    taken = set(spread)
    rest = sorted((r for r in range(n_items) if r not in taken), key=lambda r: (-float(norms[r]), r))
    return sorted(spread + rest[: size - len(spread)])


@pytest.mark.parametrize("n_items, k, requested", [
    (100_000, 1_000, 0), (70_000, 1_000, 0), (1_000_000, 100, 0), (200_001, 4_096, 0), (20_000, 300, 0),
    (33_000, 2_000, 0), (20_000, 300, 8_192), (9_000, 37, 4_096), (4_099, 1, 2_049)])
@pytest.mark.parametrize("norms_kind", [None, "spread", "ties", "rising"])
@pytest.mark.parametrize("even_every", [2, 4, 0])
def test_sample_rows(monkeypatch, n_items, k, requested, norms_kind, even_every):
    # Sorted distinct rows within the items, the sample's size, exactly the rule's rows: with norms, ties among them
    # (a few distinct values) and norms rising with the row (the largest all at the end, where the spread half is);
    # half the sample evenly spaced (as shipped, tiled.EVEN_EVERY), a quarter, or none.
    from recall.backends import tiled
    from recall.backends.tiled import sample_rows

    monkeypatch.setattr(tiled, "EVEN_EVERY", even_every)

    size = seed_size(n_items, k, 32_768, requested=requested)
    assert size
    rng = np.random.default_rng(n_items + k)
    norms = {None: None, "spread": rng.lognormal(0, 1, n_items), "ties": rng.integers(0, 4, n_items) * 1.0,
             "rising": np.arange(n_items, dtype=np.float64)}[norms_kind]
    rows = sample_rows(np, n_items, size, norms)
    assert rows.dtype == np.int64 and rows.shape == (size,)
    assert np.all(np.diff(rows) > 0) and rows[0] >= 0 and rows[-1] < n_items
    if n_items <= 200_001:
        assert rows.tolist() == _independent_sample(n_items, size, norms, even_every)


def _seed_rows(size, k, dtype):
    # Rows built to hurt recall_seed's radix select: ties (a few distinct values, crowding one histogram bin),
    # negative and mixed-sign scores, masked (-inf) items, a row with fewer than k finite scores (-inf threshold), one
    # with exactly k, values 1 ulp apart, +inf, one binade (every key's leading bits the same), small values of both
    # signs, scores crowded in a few binades as unshifted scores are, and ties within one binade; with the users'
    # vectors (user 0 zero: no margin but the underflow's) and the items' norms (some far above the rest).
    rng = np.random.default_rng(size + k)
    n = 13
    rows = rng.standard_normal((n, size)).astype(np.float32) * np.float32(3.0)
    rows[1] = np.round(rows[1])                                  # ties: a handful of values
    rows[2] = -np.abs(rows[2]) - np.float32(100.0)               # all negative
    rows[3, rng.random(size) < 0.5] = -np.inf                    # half masked
    rows[4, :] = -np.inf
    rows[4, : k - 1] = 1.0                                       # fewer than k finite: stays -inf
    rows[5, :] = -np.inf
    rows[5, rng.permutation(size)[:k]] = rng.standard_normal(k)  # exactly k finite
    rows[6] = np.float32(1.0) + np.arange(size, dtype=np.float32) * np.finfo(np.float32).eps  # 1 ulp apart
    rows[7, :3] = np.inf
    rows[8] = np.float32(7.0)                                    # one value everywhere
    rows[9] = np.float32(1000.0) + rng.random(size).astype(np.float32)  # one binade: the leading bits all shared
    rows[10, : size // 2] = np.float32(-1e-3)                    # small negatives and positives, zeros, -inf
    rows[10, size // 2:] = np.float32(1e-3) * rng.random(size - size // 2).astype(np.float32)
    rows[10, ::7] = 0.0
    rows[10, ::11] = -np.inf
    rows[11] = np.float32(0.3) + np.float32(0.05) * np.abs(rows[11])  # crowded in two binades, as unshifted scores
    rows[12] = np.float32(1000.0) + np.floor(rng.random(size) * 64).astype(np.float32) / np.float32(64)  # 64 values
    rows = rows.astype(dtype)
    users = (rng.standard_normal((n, 24)) * rng.lognormal(0, 2, (n, 1))).astype(dtype)
    users[0] = 0  # no margin but the underflow's
    norms = rng.lognormal(0, 2, size).astype(np.float32)  # items' norms, some far above the rest
    norms[: size // 3] = 0
    return rows, users, norms


def _thresholds(rows, users, norms, k, ke=0, constant=None, bias=None, sel=None):
    """recall_seed's thresholds (host) of a block of users whose sample is every one of ``rows``' columns (scores
    (n, size), no exclusions), by ``sel`` (a GPU backend's ``Selection``; a new backend's by default); the state is
    left empty."""
    import cupy

    from recall.backends import resolve
    from recall.backends.cupy.selection import GpuTopK

    n, size = rows.shape
    state = GpuTopK.allocate(n, k)
    (sel or resolve("gpu").selection).seed(
        state, cupy.asarray(rows).reshape(1, n, size), cupy.arange(size, dtype=cupy.int64), cupy.asarray(users),
        cupy.asarray(norms), cupy.zeros(n + 1, cupy.int64), cupy.zeros(0, cupy.int64), ke, constant,
        None if bias is None else (bias[0], bias[1], cupy.asarray(bias[2])))
    assert not cupy.asnumpy(state.n_valid).any() and not cupy.asnumpy(state.cnt).any()
    return cupy.asnumpy(state.thr)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("size, k", [(8192, 100), (8192, 2048), (1000, 1), (4096, 1024), (300, 37), (301, 37),
                                     (8196, 100), (16384, 1000), (16387, 1000), (32768, 1000), (32768, 2048),
                                     (65536, 8192)])
def test_seed_threshold_is_just_below_the_kth_best_sampled_score(dtype, size, k):
    # recall_seed's radix select against numpy's sort, on _seed_rows: rows of 4n scores, up to 8,192 held in
    # registers (loaded 4 at a time) and longer ones streamed from global memory (16,384 to 65,536: large-k samples),
    # and rows of 301 and 16,387 scores (streamed, 1 at a time). Every path may stop within k / 8 of the k-th.

    rows, users, norms = _seed_rows(size, k, dtype)
    got = _thresholds(rows, users, norms, k)
    for u in range(rows.shape[0]):
        _check_threshold(got[u], rows[u].astype(np.float32), norms, users[u], k, dtype, dtype, u)


@pytest.mark.parametrize("size, want", [(8192, 256), (8196, 512), (16384, 512), (16388, 1024), (32768, 1024),
                                        (32772, 256), (65536, 256), (16387, 256), (301, 256), (4, 256)])
def test_seed_block_holds_rows_of_up_to_32_keys_a_thread(size, want):
    # The block-a-user select takes the fewest threads that hold a row of a multiple of 4 in registers (32 keys a
    # thread, up to 1,024 threads); longer rows and rows of other lengths are streamed by 256.
    from recall.backends.cupy.selection import seed_threads

    assert seed_threads(size) == want


@pytest.mark.parametrize("k, need, size, n_items, ranked, want", [
    (27, 11, 512, 4096, True, (11, False)),       # k = 10 in fast mode on 4,096 items: the 11th best of the sample
    (27, 11, 512, 4096, False, (11, False)),      # evenly spaced: the estimate of 11 would be the 11th, no lower
    (27, 0, 512, 4096, True, (0, False)),         # no need: the k-th best, as without one
    (27, 27, 512, 4096, True, (0, False)),
    (27, 40, 512, 4096, True, (0, False)),        # more than k: k
    (126, 101, 8192, 1_000_000, False, (9, True)),  # an estimate of the need, not of k (mu 0.83: rank 9, not 10)
    (126, 101, 8192, 1_000_000, True, (101, False)),  # ranked where the estimate is loose: a bound of the need
    (1251, 1001, 16384, 100_000, True, (232, True)),  # tight enough for a ranked sample to estimate (mu 164)
    (376, 303, 1024, 20_000, True, (39, True)),   # the pass's estimate is tight (mu 19 at 376), the need's less so
])
def test_a_pass_starts_where_its_caller_needs(k, need, size, n_items, ranked, want):
    # selection.start_rank: where a pass that may start below its k-th best (Backend.run_blocks' left_out) starts:
    # an estimate of the caller's need where estimate_rank gives one for it, else that need's bound, never above k.
    from recall.backends.cupy.selection import estimate_rank, start_rank

    got = start_rank(k, need, size, n_items, ranked)
    assert got == want
    rank, estimated = got
    if estimated:
        assert estimate_rank(k, size, n_items, ranked) > 0
        assert rank == estimate_rank(min(need, k), size, n_items) and 0 < rank < min(need, k)
    elif rank:
        assert rank == need < k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vectors", [("float32", "float32"), ("float16", "float16"), ("float32", "float16")])
@pytest.mark.parametrize("size, k, ke", [(8196, 1000, 0), (16384, 2048, 443), (16384, 1000, 0), (24576, 2048, 0),
                                         (32768, 2048, 700), (32768, 1000, 0)])
def test_held_rows_of_wide_blocks_select_what_streamed_rows_do(monkeypatch, dtype, vectors, size, k, ke):
    # Rows of 8,193 to 32,768 scores are held by blocks of 512 or 1,024 threads; the same rows streamed by 256
    # threads (every pass reading the row again) go through the same select of the same keys: the same thresholds,
    # bit for bit, and each within the select's bracket of the oracle's.
    from recall.backends.cupy import selection

    rows, users, norms = _seed_rows(size, k, dtype)
    users = users.astype(vectors)
    assert selection.seed_threads(size) > selection.SEED_THREADS
    held = _thresholds(rows, users, norms, k, ke)
    monkeypatch.setattr(selection, "SEED_BLOCKS", (selection.SEED_THREADS,))
    assert selection.seed_threads(size) == selection.SEED_THREADS
    streamed = _thresholds(rows, users, norms, k, ke)
    np.testing.assert_array_equal(held, streamed)
    _check_rows(held, rows, norms, users, k, ke, dtype, vectors)


def _lane_rows(size, k, dtype):
    """_seed_rows, and rows whose best scores all sit in one lane's share of the warp-a-user select (lane 0: columns
    4j..4j+3 of every 128 where size is a multiple of 4, else every 32nd), so that lane keeps fewer of them than the
    rank needs: far above the rest; the only finite ones (its M kept then hold fewer than the rank); ties there."""
    rows, users, norms = _seed_rows(size, k, dtype)
    lane0 = (np.arange(size) % 128 < 4) if size % 4 == 0 else (np.arange(size) % 32 == 0)
    rng = np.random.default_rng(size + 3 * k)
    extra = rng.standard_normal((3, size)).astype(np.float32)
    extra[0, lane0] += np.float32(100.0)
    extra[1, ~lane0] = -np.inf
    extra[2, lane0] = np.float32(50.0)
    n_extra = extra.shape[0]
    users = np.concatenate([users, users[1:1 + n_extra]])
    return np.concatenate([rows, extra.astype(dtype)]), users, norms


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vectors", [("float32", "float32"), ("float16", "float16"), ("float32", "float16")])
@pytest.mark.parametrize("size, k, ke", [(8192, 100, 0), (2048, 126, 30), (4096, 1024, 120), (301, 37, 0),
                                         (302, 37, 9), (16384, 128, 0), (1000, 1, 0), (2048, 128, 0),
                                         (65536, 100, 0)])
def test_warp_seed_select_is_exact_whatever_a_lane_holds(monkeypatch, dtype, vectors, size, k, ke):
    # Ranks up to 128 in rows of up to 65,536 take the warp-a-user select: exactly the rank-th best lowered sampled
    # score (no early stop), also where one lane holds the row's best scores (its M kept keys fall short: the
    # bisection goes on over the whole row) or its only finite ones; never below the block-a-user select's threshold
    # of the same rows, which may stop within rank / 8.
    from recall.backends.cupy import selection

    rows, users, norms = _lane_rows(size, k, dtype)
    users = users.astype(vectors)
    got = {True: _thresholds(rows, users, norms, k, ke)}
    monkeypatch.setattr(selection, "SEED_WARP_RANK", 0)  # the block-a-user select, on the same rows
    got[False] = _thresholds(rows, users, norms, k, ke)
    held = _check_rows(got[True], rows, norms, users, k, ke, dtype, vectors, exact=True)
    for u in np.flatnonzero(held):
        assert got[True][u] >= got[False][u], (u, got[True][u], got[False][u])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vectors", [("float32", "float32"), ("float16", "float16"), ("float32", "float16")])
@pytest.mark.parametrize("size, k, ke", [(512, 10, 0), (1024, 10, 0), (1024, 16, 0), (2048, 100, 12), (301, 16, 0),
                                         (302, 37, 9), (1000, 1, 0), (4096, 16, 9), (16384, 10, 0), (65536, 16, 0),
                                         (512, 27, 0), (302, 37, 0), (1024, 64, 0), (2048, 100, 40), (4096, 50, 0),
                                         (65536, 64, 0)])
def test_warp_select_keeping_8_keys_a_lane_equals_16(monkeypatch, dtype, vectors, size, k, ke):
    # Ranks up to SEED_WARP_SMALL_RANK (64) take the warp-a-user select whose lanes keep 8 keys (recall_seed_warp*8);
    # its thresholds must be the 16-key select's, bit for bit, on the rows that hurt it: one lane holding the row's
    # best (its 8 kept fall short: the bisection goes on over the whole row), ties, short and masked rows.
    from recall.backends import resolve
    from recall.backends.cupy import selection

    rows, users, norms = _lane_rows(size, k, dtype)
    users = users.astype(vectors)
    sel, used = resolve("gpu").selection, []

    def recorded(key, kernel):
        def launch(*args):
            used.append(key[2])
            return kernel(*args)
        return launch

    sel.seed_warp = {key: recorded(key, kernel) for key, kernel in sel.seed_warp.items()}
    got = _thresholds(rows, users, norms, k, ke, sel=sel)
    assert used == [8]
    monkeypatch.setattr(selection, "SEED_WARP_SMALL_RANK", 0)  # the 16-key select, on the same rows
    np.testing.assert_array_equal(got, _thresholds(rows, users, norms, k, ke, sel=sel))
    assert used == [8, 16]
    _check_rows(got, rows, norms, users, k, ke, dtype, vectors, exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vectors", [("float32", "float32"), ("float16", "float16"), ("float32", "float16")])
@pytest.mark.parametrize("size, k, ke", [(1024, 10, 0), (1024, 10, 8), (2048, 32, 0), (2048, 100, 30), (301, 37, 0),
                                         (302, 37, 9), (1000, 1, 0), (4096, 33, 0), (16384, 16, 0)])
def test_popping_warp_select_equals_the_bisection(monkeypatch, dtype, vectors, size, k, ke):
    # The warp-a-user select pops ranks up to RECALL_SEED_POP_RANK (32) off the lanes' kept keys; its thresholds must
    # be the bisection's (the build with -DRECALL_SEED_BISECT, measurement only: as before 2026-12-05), bit for bit,
    # on the rows that hurt the select (ties, one value everywhere, short and masked rows, best scores in one lane's
    # share) and at ranks above 32 (the bisection in both builds).
    from recall.backends.cupy import kernels

    rows, users, norms = _lane_rows(size, k, dtype)
    users = users.astype(vectors)
    got = _thresholds(rows, users, norms, k, ke)
    monkeypatch.setattr(kernels, "selection_module",
                        lambda: kernels.module(kernels.SELECTION_SOURCES, ("-DRECALL_SEED_BISECT",)))
    np.testing.assert_array_equal(got, _thresholds(rows, users, norms, k, ke))
    assert any("-DRECALL_SEED_BISECT" in key[2] for key in kernels._modules)  # the second select was the bisection's


def _check_rows(got, rows, norms, users, k, ke, dtype, vectors, exact=False):
    """Each user's threshold of a seed select of rank ``ke`` (where 0 < ke < k, else k): -inf where fewer than k of
    its sampled scores are finite, else within :func:`_check_threshold`'s bracket. Returns which users held k."""
    rank = ke if 0 < ke < k else k
    held = np.zeros(rows.shape[0], bool)
    for u in range(rows.shape[0]):
        sampled = rows[u].astype(np.float32)
        if np.sum(sampled > -np.inf) < k:
            assert got[u] == -np.inf, (u, got[u])
            continue
        held[u] = True
        _check_threshold(got[u], sampled, norms, users[u], rank, dtype, vectors, u, exact=exact)
    return held


def _check_threshold(got, sampled, norms, user, k, score_dtype, vector_dtype, where, products=None, exact=False):
    # recall_seed's threshold for one user: below the k-th best of the sampled scores each lowered by its margin
    # (certificate.seed_margin, in float64 here), and not by much more: either the select resolved the k-th itself
    # (ties and all), the threshold then above the k-th best of scores lowered by a hair more than that and a few
    # float32 steps (the kernel rounds each step down), or it stopped early, with at most k + k / 8 sampled scores so
    # lowered above the threshold; -inf where fewer than k sampled scores are finite, the largest float below an
    # infinite k-th best. ``products``: the bound P_j of sum |u_i v_ji| of each sampled item (default |u| |v_j|);
    # ``exact``: the select resolved the k-th itself.
    from recall.core.certificate import flush_factor, seed_margin

    a, r, z = seed_margin(user.size, np.dtype(vector_dtype) == np.float16, np.dtype(score_dtype) == np.float16)
    unorm = float(np.sqrt(np.sum(user.astype(np.float64) ** 2)))
    keep = sampled > -np.inf
    s = sampled[keep].astype(np.float64)
    vn = norms[keep].astype(np.float64) * unorm if products is None else products[keep]
    # Float32 vectors: the select lowers by φ·(|u| + |v_j|) more (one GEMM may flush inputs below 2^-126, the other
    # not), at most this much (|u| here over every column).
    flushed = 0.0 if np.dtype(vector_dtype) == np.float16 else flush_factor(user.size) * (unorm + norms[keep])
    if s.size < k:
        assert got == -np.inf, (where, got)
        return
    finite = np.isfinite(s)
    with np.errstate(invalid="ignore"):  # the infinite scores' margins: not used
        margin = a * vn + r * np.abs(s) + z
        high = np.where(finite, s - margin, s)
        low = np.where(finite, s - 1.0001 * (margin + flushed) - 4 * np.spacing(np.abs(s).astype(np.float32)), s)
    hi, lo = np.sort(high)[::-1][k - 1], np.sort(low)[::-1][k - 1]
    top = np.finfo(np.float32).max
    assert got < hi or (np.isinf(hi) and got == top), (where, got, hi)
    # The kernels flush subnormal floats to zero (-ftz=true): a k-th best lowered score within FLT_MIN of zero is
    # zero there, and the float just below it -FLT_MIN.
    tiny = float(np.finfo(np.float32).tiny)
    resolved = (got == top if np.isinf(hi)
                else got >= lo - np.spacing(np.float32(abs(lo))) or (abs(lo) < tiny and got >= -tiny))
    assert resolved or (not exact and np.sum(low > got) <= k + k // 8), (where, got, int(np.sum(low > got)), k, lo)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vectors", [("float32", "float32"), ("float16", "float16"), ("float32", "float16")])
@pytest.mark.parametrize("bias, size, k, ke", [
    (False, 8192, 126, 0), (False, 8192, 1251, 280), (False, 16384, 1251, 280), (False, 301, 37, 0),
    (True, 8192, 126, 0), (True, 8192, 126, 40), (True, 16384, 2113, 443), (True, 301, 37, 0), (True, 302, 37, 20)])
def test_seed_margin_takes_the_constant_and_bias_columns_on_their_own(dtype, vectors, bias, size, k, ke):
    # Rows with a column that every item holds at 2^15 (fast mode's shift column) and users at a shift of their own:
    # each sampled score is lowered by A (|u'| |v'_j| + |u_c| 2^15), the norms without that column. With ``bias``,
    # fast mode's l2 rows: every user holds one large value in both bias columns (8,192, as float16 users of l2 do),
    # each item its own small bias parts there, and the margin adds max |u_b| sum |v_jb|, the norms leaving those
    # columns out too. Held (8,192) and streamed rows (301: one score at a time; 302: 4 at a time, a warp a user at the
    # small rank), a bound and an estimate. Through the whole rows' norms the shift column would multiply every user's
    # whole norm, and the users' bias values the items' bound columns: a lowering far below this check's bracket.

    rows, _, _ = _seed_rows(size, k, dtype)
    n = rows.shape[0]
    rng = np.random.default_rng(size + k + (7 if bias else 5))
    col, lo, hi, width = 32, 33, 35, 40
    users = rng.standard_normal((n, width)).astype(np.float32)
    users[:, col] = rng.uniform(-2.0 ** -6, 2.0 ** -6, n)  # a shift of the user's own
    if bias:
        users[:, lo:hi] = (8192.0 * rng.choice([-1.0, 1.0], n))[:, None]
        users[2, lo] *= 0.5                                # the larger of the two counts
    users[0] = 0                                           # no margin but the underflow's
    if bias:
        users[1, lo:hi] = 0                                # no bias value
    else:
        users[1, col] = 0                                  # no shift
    users = users.astype(vectors)
    vnorm = rng.lognormal(0, 1, size).astype(np.float32)   # the items' norms without those columns
    vnorm[: size // 5] = 0
    sums = (rng.lognormal(0, 2, size) * 1e-3).astype(np.float32) if bias else np.zeros(size)  # sums of |bias parts|
    sums[size // 3: size // 2] = 0
    got = _thresholds(rows, users, vnorm, k, ke, (col, 2.0 ** 15), (lo, hi, sums) if bias else None)
    u64 = users.astype(np.float64)
    rest = np.sqrt(np.sum(np.delete(u64, [col, lo, lo + 1] if bias else [col], axis=1) ** 2, axis=1))
    for u in range(n):
        sampled = rows[u].astype(np.float32)
        if np.sum(sampled > -np.inf) < k:  # fewer than k finite, estimate or not: -inf
            assert got[u] == -np.inf, (u, got[u])
            continue
        products = rest[u] * vnorm.astype(np.float64) + abs(u64[u, col]) * 2.0 ** 15
        if bias:
            products = products + np.abs(u64[u, lo:hi]).max() * sums.astype(np.float64)
        _check_threshold(got[u], sampled, vnorm, users[u], ke or k, dtype, vectors, u, products)


@pytest.mark.gpu
def test_item_samples_split_the_bias_columns_norms_off():
    # DeviceItems with bias columns: each sampled item's norm without the shift and bias columns and its sum of
    # |bias parts|, rounded up to float32 (at or above the float64 values, by less than a float32 step); without
    # bias columns the whole rows' norms (the shift column left out) and no sums.

    import cupy

    from recall.backends.cupy.items import DeviceItems

    rng = np.random.default_rng(11)
    vecs = (rng.standard_normal((5000, 40)) * rng.lognormal(0, 2, (5000, 1))).astype(np.float16)
    vecs[:, 32] = 2.0 ** 15
    v64 = vecs.astype(np.float64)
    for bias in (None, (33, 35)):
        items = DeviceItems(cupy.asarray(vecs), constant_column=(32, 2.0 ** 15), bias_columns=bias)
        rows, norms, sums = items.sample(1024, 5000, cupy.cuda.get_current_stream(), even=True)
        rows = cupy.asnumpy(rows)
        drop = [32] + ([] if bias is None else [33, 34])
        want = np.sqrt(np.sum(np.delete(v64[rows], drop, axis=1) ** 2, axis=1))
        got = cupy.asnumpy(norms).astype(np.float64)
        assert (got >= want).all() and (got <= want * (1 + 2.0 ** -23)).all()
        if bias is None:
            assert sums is None
            continue
        want_sums = np.abs(v64[rows, 33:35]).sum(axis=1)
        got_sums = cupy.asnumpy(sums).astype(np.float64)
        assert (got_sums >= want_sums).all() and (got_sums <= want_sums * (1 + 2.0 ** -23)).all()


@pytest.mark.parametrize("skip", [set(), {0}, {39}, {32}, {32, 33, 34}, {0, 1, 38, 39}, set(range(40))])
def test_norms_without_columns(skip):
    # The rows' norms over the columns kept (runs combined by hypot), float64, against NumPy over the columns deleted;
    # without a skipped column exactly row_norms, with every column skipped zeros.
    from recall.backends.cupy.items import norms_without
    from recall.core.metrics import row_norms

    rng = np.random.default_rng(len(skip))
    vecs = (rng.standard_normal((300, 40)) * rng.lognormal(0, 2, (300, 1))).astype(np.float16)
    got = norms_without(np, vecs, skip)
    want = np.linalg.norm(np.delete(vecs.astype(np.float64), sorted(skip), axis=1), axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
    if not skip:
        np.testing.assert_array_equal(got, row_norms(np, vecs))


def test_fast_items_name_their_bias_columns():
    # l2's float16 items carry the bias in two columns after the shift column (certificate.prepare_items): the
    # columns a threshold sample's margin bounds on their own; none without a bias.
    from recall.core.certificate import prepare_items

    rng = np.random.default_rng(2)
    items = rng.standard_normal((50, 9)).astype(np.float32)
    biased = prepare_items(np, items, bias_col=8)
    assert biased.bias_columns == (biased.bias_at, biased.bias_at + 2) == (9, 11)
    assert biased.constant_column[0] == 8
    assert prepare_items(np, items[:, :8]).bias_columns is None


def test_seed_margin_bounds_two_sums_of_the_same_products():
    # The margin's first term against what reordering does to float32 sums: many orders of the same products of
    # one user and one item never differ by more than A |u| |v|, on data made to cancel.
    from recall.core.certificate import seed_margin

    rng = np.random.default_rng(3)
    width = 96
    for trial in range(200):
        u = (rng.standard_normal(width) * 10.0 ** rng.uniform(-3, 3, width)).astype(np.float32)
        v = (rng.standard_normal(width) * 10.0 ** rng.uniform(-3, 3, width)).astype(np.float32)
        a, _, z = seed_margin(width, False, False)
        sums = []
        for _ in range(6):
            order = rng.permutation(width)
            acc = np.float32(0)
            for i in order:
                acc = np.float32(acc + u[i] * v[i])
            sums.append(float(acc))
        assert max(sums) - min(sums) <= a * float(np.linalg.norm(u) * np.linalg.norm(v)) + z


@pytest.mark.parametrize("scale", [1e-20, 1e-39, 1.0])
def test_seed_margin_bounds_a_sum_that_flushes_against_one_that_does_not(scale):
    # The GPU's kernels read float32 inputs below 2^-126 as 0 and write results below it as 0 (-ftz=true), where
    # cuBLAS and the CPU keep subnormals: a sample scored by one and a search by the other differ by at most
    # A |u| |v| + φ (|u| + |v|) + Z (certificate.flush_factor, which the GPU's select adds for float32 vectors;
    # Z: certificate.float32_floor, twice). Rows near 10^-20 (products near 10^-40, each flushed), items of
    # subnormal components against users of 10^20, and rows of ordinary scale.
    from recall.core.certificate import flush_factor, seed_margin

    tiny = np.float32(2.0 ** -126)

    def flush(x):
        return np.where(np.abs(x) < tiny, np.float32(0), x).astype(np.float32)

    rng = np.random.default_rng(4)
    width = 40
    a, _, z = seed_margin(width, False, False)
    phi = flush_factor(width)
    worst = 0.0
    with np.errstate(under="ignore"):
        for trial in range(300):
            u = rng.standard_normal(width) * (1e20 if scale == 1e-39 else scale)
            v = rng.standard_normal(width) * scale * 10.0 ** rng.uniform(-1, 1, width)
            u, v = u.astype(np.float32), v.astype(np.float32)
            kept = np.float32(0)
            for i in rng.permutation(width):
                kept = np.float32(kept + u[i] * v[i])
            flushed = np.float32(0)
            fu, fv = flush(u), flush(v)
            for i in rng.permutation(width):
                flushed = flush(np.float32(flushed + flush(np.float32(fu[i] * fv[i]))))
            nu, nv = float(np.linalg.norm(u.astype(np.float64))), float(np.linalg.norm(v.astype(np.float64)))
            gap = abs(float(kept) - float(flushed))
            assert gap <= a * nu * nv + phi * (nu + nv) + z, (trial, gap)
            worst = max(worst, gap / (a * nu * nv + 2 * width * 2.0 ** -149))
    if scale != 1.0:
        assert worst > 1  # (the case the terms are for: the margin of subnormal rounding alone would not cover it)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vectors", [("float32", "float32"), ("float16", "float16"), ("float32", "float16")])
def test_seed_masks_the_excluded_rows_of_any_sample(dtype, vectors):
    # A sample of scattered rows (as the largest norms leave it): each user's excluded items, sampled or not, in and
    # past the rows' range, the first and last sampled rows, every sampled row for one user, none for another.
    from recall.backends import resolve
    from recall.backends.cupy.selection import GpuTopK

    import cupy

    rng = np.random.default_rng(11)
    n_items, size, k, n = 50_000, 3_000, 20, 9
    rows = np.sort(rng.choice(n_items, size, replace=False)).astype(np.int64)
    scores = rng.standard_normal((n, size)).astype(dtype)
    excluded = [rng.choice(n_items, 400, replace=False) for _ in range(n)]
    excluded[1] = rows.copy()                                                    # every sampled row
    excluded[2] = np.zeros(0, np.int64)                                          # none
    excluded[3] = np.array([rows[0], rows[-1], rows[-1] + 1, n_items - 1])       # the ends
    excluded[4] = rng.choice(rows, 200, replace=False)                           # sampled rows only
    excluded[5] = np.setdiff1d(np.arange(n_items), rows)[:5000]                  # no sampled row
    excluded[6] = rows[np.argsort(-scores[6].astype(np.float32))[:k]]            # the k best sampled
    excluded = [np.unique(e).astype(np.int64) for e in excluded]
    indptr = np.concatenate([[0], np.cumsum([e.size for e in excluded])]).astype(np.int64)
    backend = resolve("gpu")
    state = GpuTopK.allocate(n, k)
    gpu_scores = cupy.asarray(scores).reshape(1, n, size)
    users = rng.standard_normal((n, 40)).astype(vectors)
    norms = rng.uniform(0, 3, size).astype(np.float32)
    backend.selection.seed(state, gpu_scores, cupy.asarray(rows), cupy.asarray(users), cupy.asarray(norms),
                           cupy.asarray(indptr), cupy.asarray(np.concatenate(excluded)))
    got = cupy.asnumpy(state.thr)
    for u in range(n):
        sampled = np.where(np.isin(rows, excluded[u]), -np.inf, scores[u].astype(np.float32))
        _check_threshold(got[u], sampled, norms, users[u], k, dtype, vectors, u)  # 3,000 scores: held


@pytest.mark.parametrize("plan, n_users, n_items, k, dim, dtype, options, want", [
    ((2048, 8192, 4), 100_000, 1_000_000, 100, 64, "float32", {}, True),      # S1: seeded, fused
    ((4096, 8192, 4), 10_000, 1_000_000, 4096, 64, "float32", {}, True),      # seeded k = 4,096: fused
    ((2048, 16384, 4), 10_000, 1_000_000, 8192, 64, "float32", {}, True),     # seeded k = 8,192: fused
    ((2048, 32768, 4), 10_000, 1_000_000, 16384, 64, "float32", {}, False),   # seeded k = 16,384: cuBLAS + filter
    ((2048, 16384, 4), 10_000, 1_000_000, 5121, 80, "float16", {}, True),     # the float16 pass of k = 4,096
    ((2048, 16384, 4), 10_000, 1_000_000, 5122, 80, "float16", {}, False),    # one more: cuBLAS + filter
    ((2048, 8192, 1), 10_000, 1_000_000, 8192, 64, "float32", {}, True),      # unseeded (no room), k = 8,192: fused
    ((4096, 8192, 4), 200_000, 100_000, 1000, 32, "float32", {}, True),       # a small catalogue, seeded: fused
    ((2048, 8192, 4), 100_000, 60_000, 100, 64, "float32", {}, True),         # k small for it, seeded: fused
    ((2048, 8192, 4), 100_000, 8_000, 10, 64, "float32", {}, True),           # under 8,192 items, seeded: fused
    ((2048, 8192, 4), 100_000, 1_000, 1, 64, "float32", {}, False),           # unseeded (under 128 sampled): cuBLAS
    ((2048, 8192, 4), 100, 1_000_000, 100, 64, "float32", {}, False),         # fewer users than a kernel tile
    ((2048, 8192, 4), 100, 1_000_000, 100, 64, "float32", {"fused": "force"}, True),
    ((2048, 8192, 4), 100_000, 1_000_000, 100, 64, "float32", {"fused": "off"}, False),
    ((2048, 8192, 4), 100_000, 1_000_000, 100, 257, "float32", {}, False),    # wider than the kernel's 256
    ((2048, 8192, 4), 100_000, 1_000_000, 100, 80, "float16", {}, True),      # fast mode's rows of S1
    ((2048, 8192, 4), 100_000, 1_000_000, 100, 264, "float16", {}, False),    # d = 256 in fast mode: cuBLAS
])
def test_which_searches_take_the_fused_path(plan, n_users, n_items, k, dim, dtype, options, want):
    from recall.backends.cupy import fused
    from recall.core.options import EngineOptions
    from recall.core.tiling import TilePlan

    assert fused.applies(TilePlan(*plan), n_users, n_items, k, dim, np.dtype(dtype), EngineOptions(**options)) is want


@pytest.mark.parametrize("k, size, n_items", [
    (126, 8192, 1_000_000), (2561, 32768, 1_000_000), (1251, 16384, 100_000), (126, 8192, 100_000),
    (1251, 32768, 1_000_000), (12, 8192, 1_000_000), (37, 300, 600), (5000, 65536, 100_000)])
def test_estimate_rank_is_rarely_reached_and_passes_fewer(k, size, n_items):
    # The estimate's rank KE in a sample of evenly spaced rows: the count of sampled items above a user's k-th best
    # is about Poisson(mu), mu = k * size / n_items; it reaches KE for under 1e-6 of the users, and KE < k (fewer
    # items pass than from the k-th best), else no estimate (0).
    import math

    from recall.backends.cupy.selection import estimate_rank

    ke = estimate_rank(k, size, n_items)
    mu = k * size / n_items
    # A sample that would take half its rows from the largest norms estimates only where the estimate is tight.
    assert estimate_rank(k, size, n_items, ranked=True) == (ke if mu >= 16 else 0)
    if ke == 0:
        assert math.ceil(mu + 5 * math.sqrt(mu)) + 3 >= k
        return
    tail = 1.0 - sum(math.exp(-mu + j * math.log(mu) - math.lgamma(j + 1)) for j in range(ke))
    assert tail < 1e-6, (ke, mu, tail)
    assert ke < k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vectors", [("float32", "float32"), ("float16", "float16"), ("float32", "float16")])
@pytest.mark.parametrize("size, k, ke", [(8192, 126, 10), (8192, 126, 300), (4096, 1024, 40), (300, 37, 5),
                                         (301, 37, 5), (16384, 1251, 277), (16387, 1000, 40), (32768, 2561, 133)])
def test_seed_estimate_is_the_ke_th_best_sampled_score(dtype, vectors, size, k, ke):
    # recall_seed with an estimate rank KE: the KE-th best lowered sampled score where KE < k (else the k-th, a
    # bound); -inf still where fewer than k sampled scores are finite. The select may stop within KE / 8, as before.

    rows, users, norms = _seed_rows(size, k, dtype)
    users = users.astype(vectors)
    got = _thresholds(rows, users, norms, k, ke)
    for u in range(rows.shape[0]):
        sampled = rows[u].astype(np.float32)
        if np.sum(sampled > -np.inf) < k:
            assert got[u] == -np.inf, (u, got[u])
            continue
        _check_threshold(got[u], sampled, norms, users[u], min(k, ke), dtype, vectors, u)


@pytest.mark.parametrize("k_pad, want", [(1, 64), (16, 64), (64, 64), (128, 256), (2048, 256)])
def test_merge_blocks_shrink_for_small_states(k_pad, want):
    # The fused path's merge: 64 threads a user where it keeps at most 64 keys (the kernel takes any multiple of 32).
    from recall.backends.cupy import fused

    assert fused.merge_threads(k_pad) == want


@pytest.mark.parametrize("tiles, seg, first, want", [
    (157, 512, 0, [(0, 157)]),                   # one launch, as without a first segment
    (157, 512, 36, [(0, 36), (36, 121)]),        # 4,608 items, then the other 20,096
    (10, 512, 36, [(0, 10)]),                    # a first segment past the catalogue: one launch
    (1000, 512, 36, [(0, 36), (36, 512), (548, 452)]),
    (1024, 512, 0, [(0, 512), (512, 512)]),
    (1024, 512, 600, [(0, 512), (512, 512)]),    # never longer than a segment
    (0, 512, 0, []), (0, 512, 8, []),           # no items: no launch (the final merge of nothing runs alone)
])
def test_fused_launches_cover_every_tile_once(tiles, seg, first, want):
    # EngineOptions.fused_first_segment: the first launch's tiles, then segments; every tile in exactly one launch.
    from recall.backends.cupy import fused

    got = fused.segments(tiles, seg, first)
    assert got == want
    assert [t for t0, nt in got for t in range(t0, t0 + nt)] == list(range(tiles))


@pytest.mark.parametrize("value", [-1, 1.5, "4096", "Auto", None, True])
def test_first_segment_option_is_a_count_of_items(value):
    from recall import EngineOptions, InputError

    with pytest.raises(InputError, match=r"options.fused_first_segment must be an integer >= 0 or 'auto'"):
        EngineOptions(fused_first_segment=value)
    assert EngineOptions(fused_first_segment="auto").fused_first_segment == "auto"


@pytest.mark.parametrize("option, sample, n_items, even, want", [
    (0, 1024, 20_000, True, 0),              # a number is the number, the rule or not
    (4096, 1024, 20_000, False, 4096),
    ("auto", 1024, 20_000, True, 4525),      # sqrt(1,024 x 20,000) = 4,525.5: the isqrt
    ("auto", 1024, 20_000, False, 0),        # half the sample from the largest norms: one launch
    ("auto", 0, 20_000, True, 0),            # no sample, no rule
    ("auto", 8192, 16_384, True, 0),         # sqrt = 11,585 > half the catalogue: one launch
    ("auto", 4096, 16_384, True, 8192),      # exactly half: taken
    ("auto", 8192, 1_000_000, True, 90_509),  # past a segment: segments() caps it at one
])
def test_first_launch_rule(option, sample, n_items, even, want):
    # EngineOptions.fused_first_segment="auto": sqrt(sample x items) where the sample is evenly spaced and that is at
    # most half the catalogue (fused.first_launch).
    from recall.backends.cupy import fused

    assert fused.first_launch(option, sample, n_items, even) == want


@pytest.mark.parametrize("n_items, first, seg, want", [
    (20_000, 0, 65_536, [(0, 157, True, 256)]),                         # one launch, the final merge
    (20_000, 4_525, 65_536, [(0, 36, False, 0), (36, 121, True, 256)]),  # the first merge folds all it passed
    (200_000, 4_096, 65_536, [(0, 32, False, 0), (32, 512, False, 256), (544, 512, False, 256),
                              (1056, 507, True, 256)]),
    (3_000, 4_096, 65_536, [(0, 24, True, 256)]),                        # a first launch past the catalogue
])
def test_fused_launches_and_their_merges(n_items, first, seg, want):
    # FusedSearch.search's schedule with the kernels stood in for: each launch's tiles, then its merge; a shorter
    # first launch's merge takes high water 0 (the merge kernel otherwise leaves up to merge_high_water candidates a
    # user in the buffer and the thresholds where they were), later merges fold only past merge_high_water.
    from types import SimpleNamespace

    from recall import EngineOptions
    from recall.backends.cupy import fused

    calls = []
    k, capacity = 10, 16_384
    state = SimpleNamespace(top=0, n_valid=0, thr=0, cand=0, cnt=0, base=0, k=k, cand_capacity=capacity,
                            out_vals=0, out_rows=0)
    launch = lambda grid, t0, nt, per_cta: calls.append(("launch", t0, nt))  # noqa: E731
    # The merge's arguments: the state's six arrays (no operands here), start, n_tile, n_items, k, K_pad, capacity,
    # high water, final code, then the outputs and exclusions.
    merge = lambda grid, block, args, shared_mem: calls.append(("merge", int(args[6]), int(args[7]), int(args[12]),
                                                                 int(args[13])))  # noqa: E731
    search = fused.FusedSearch(SimpleNamespace(merge_smem=lambda k: (16, 8 * 16)))
    search._single = lambda *a: (launch, (merge, {8: merge, 16: merge}), ())  # the block's and the warps' merges
    users = np.zeros((300, 24), np.float32)
    search.search(None, users, None, n_items, state, None, None, False, EngineOptions(fused_segment=seg), first=first)
    got = []
    for i in range(0, len(calls), 2):
        (_, t0, nt), (_, start, n_tile, high_water, final) = calls[i], calls[i + 1]
        assert start == t0 * 128 and n_tile == min(nt * 128, n_items - start)
        got.append((t0, nt, final == 1, high_water))
    assert got == want


@pytest.mark.parametrize("k_pad, warp_k, held, want", [
    (16, 64, 8, ("warp", 8)), (64, 64, 16, ("warp", 16)), (128, 64, 8, ("block", 256)), (32, 0, 8, ("block", 64)),
    (64, 32, 8, ("block", 64)),
])
def test_fused_merge_takes_a_warp_a_user_up_to_merge_warp_k(monkeypatch, k_pad, warp_k, held, want):
    # fused.MERGE_WARP_K: a state of at most that many keys a user (K rounded up to a power of two) is merged one
    # warp a user by the kernel keeping MERGE_WARP_HELD keys a lane: 8 users a block of 256 threads, 8 warps' shared
    # memory, the block's users counted in its last argument; else one block a user (64 threads up to
    # MERGE_SMALL_K keys, 256 past it). Kernels stood in for.
    from types import SimpleNamespace

    from recall import EngineOptions
    from recall.backends.cupy import fused

    monkeypatch.setattr(fused, "MERGE_WARP_K", warp_k)
    monkeypatch.setattr(fused, "MERGE_WARP_HELD", held)
    calls = []

    def kernel(name):
        return lambda grid, block, args, shared_mem: calls.append((name, grid, block, shared_mem, args))

    state = SimpleNamespace(top=0, n_valid=0, thr=0, cand=0, cnt=0, base=0, k=k_pad, cand_capacity=16_384,
                            out_vals=0, out_rows=0)
    search = fused.FusedSearch(SimpleNamespace(merge_smem=lambda k: (k_pad, 8 * k_pad)))
    merges = (kernel("block"), {8: kernel("warp8"), 16: kernel("warp16")})
    search._single = lambda *a: (lambda *b: None, merges, ())
    users = np.zeros((300, 24), np.float32)
    search.search(None, users, None, 20_000, state, None, None, False, EngineOptions())
    assert len(calls) == 1
    name, grid, block, smem, args = calls[0]
    if want[0] == "warp":
        assert name == f"warp{want[1]}" and grid == (38,) and block == (256,) and smem == 8 * 8 * k_pad
        assert int(args[-1]) == 300 and len(args) == 20  # (no operands here)
    else:
        assert name == "block" and grid == (300,) and block == (want[1],) and smem == 8 * k_pad and len(args) == 19
