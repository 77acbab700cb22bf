"""Tiling: ``plan_tiles`` (fit the budget, shrink in the documented order), ``item_segments`` (cover every item once,
in order) and block search over multi-tile strided-batched GEMMs (the path the GPU takes: several item tiles per
call), run here through the CPU backend."""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from recall import Engine, EngineOptions, ResourceError
from recall.backends.numpy import NumpyBackend
from recall.backends.tiled import item_ranges
from recall.core.tiling import WIDEST_FEW_USERS_TILE, TilePlan, item_segments, plan_tiles


def _shrink_sequence(start: TilePlan, state: int = 0) -> list[TilePlan]:
    """The documented order, written out independently: tiles per call halve to 1, then the item tile halves down
    to 256, then the user block halves to 1, then the concurrent workers halve to 1, then the item tile halves to 1;
    but while a user's state outweighs its row of the call's tiles, the user block halves first."""
    seq = [start]
    u, t, c, w = start.user_block, start.item_tile, start.tiles_per_call, start.workers
    while True:
        if u > 1 and state > 4 * t * c:
            u //= 2
        elif c > 1:
            c //= 2
        elif t > 256 and (u == 1 or state <= 4 * t):
            t //= 2
        elif u > 1:
            u //= 2
        elif w > 1:
            w //= 2
        elif t > 1:
            t //= 2
        else:
            return seq
        seq.append(TilePlan(u, t, c, w))


def test_plan_is_preferred_when_it_fits():
    plan = plan_tiles(10_000, 100_000, 64, 100, 1 << 40, (256, 4096, 4), 1200)
    assert plan == TilePlan(256, 4096, 4)


def test_plan_clips_to_the_problem():
    plan = plan_tiles(3, 1000, 8, 10, 1 << 40, (256, 4096, 4), 120)
    assert plan == TilePlan(3, 1000, 1)
    plan = plan_tiles(500, 9000, 8, 10, 1 << 40, (256, 4096, 8), 120)
    assert plan == TilePlan(256, 4096, 3)  # ceil(9000 / 4096) tiles cover the items


@pytest.mark.parametrize("preferred, workers", [((256, 4096, 8), 1), ((64, 1024, 3), 4), ((5, 300, 1), 3),
                                                 ((1, 1, 1), 2)])
def test_shrink_order(preferred, workers):
    n_users, n_items, dim, k, state = 100_000, 1_000_000, 32, 50, 600
    seq = _shrink_sequence(TilePlan(*preferred, workers))
    sizes = [p.workspace_bytes(dim, k, state) for p in seq]
    assert all(a > b for a, b in zip(sizes, sizes[1:])), "each step must shrink the workspace"
    for i, (plan, size) in enumerate(zip(seq, sizes)):
        # A budget of exactly this plan's workspace gives this plan: the first in the order that fits ...
        assert plan_tiles(n_users, n_items, dim, k, size, preferred, state, workers) == plan
        # ... and one byte less the next one.
        if i + 1 < len(seq):
            assert plan_tiles(n_users, n_items, dim, k, size - 1, preferred, state, workers) == seq[i + 1]
    with pytest.raises(ResourceError):
        plan_tiles(n_users, n_items, dim, k, sizes[-1] - 1, preferred, state, workers)


@pytest.mark.parametrize("state", [600, 40_000, 2_264_000])
def test_shrink_order_with_large_states(state):
    # Large k: a user's top-k state outweighs its scores, and the user block halves before the item tile narrows.
    preferred, dim, k = (4096, 8192, 4), 64, 8192
    seq = _shrink_sequence(TilePlan(*preferred), state)
    sizes = [p.workspace_bytes(dim, k, state) for p in seq]
    assert all(a > b for a, b in zip(sizes, sizes[1:]))
    for i, (plan, size) in enumerate(zip(seq, sizes)):
        assert plan_tiles(10_000, 1_000_000, dim, k, size, preferred, state) == plan
        if i + 1 < len(seq):
            assert plan_tiles(10_000, 1_000_000, dim, k, size - 1, preferred, state) == seq[i + 1]


def test_large_k_keeps_wide_item_tiles():
    # k = 8192 on the GPU: 2.26 MB of state a user; an 8 GB budget halves the block, not the 8192-item tile nor the
    # tiles a call holds (the room for the threshold sample).
    plan = plan_tiles(10_000, 1_000_000, 64, 8192, 8 << 30, (4096, 16384, 4), 2_264_000)
    assert plan == TilePlan(2048, 16384, 4)


def test_shrinks_tiles_first_then_item_tile_then_users():
    preferred = (128, 2048, 4)
    dim, k, state = 16, 10, 120
    full = TilePlan(*preferred).workspace_bytes(dim, k, state)
    p = plan_tiles(10**6, 10**6, dim, k, full - 1, preferred, state)
    assert (p.user_block, p.item_tile) == (128, 2048) and p.tiles_per_call < 4
    p = plan_tiles(10**6, 10**6, dim, k, TilePlan(128, 2048, 1).workspace_bytes(dim, k, state) - 1, preferred, state)
    assert p.user_block == 128 and p.tiles_per_call == 1 and p.item_tile < 2048
    p = plan_tiles(10**6, 10**6, dim, k, TilePlan(128, 256, 1).workspace_bytes(dim, k, state) - 1, preferred, state)
    assert p.item_tile == 256 and p.user_block < 128
    p = plan_tiles(10**6, 10**6, dim, k, TilePlan(1, 256, 1).workspace_bytes(dim, k, state) - 1, preferred, state)
    assert p.user_block == 1 and p.item_tile < 256


def test_workers_each_hold_a_workspace_and_never_outnumber_blocks():
    dim, k, state = 8, 10, 120
    one = TilePlan(4, 100, 1).workspace_bytes(dim, k, state)
    assert TilePlan(4, 100, 1, 3).workspace_bytes(dim, k, state) == 3 * one
    # 10 users in blocks of 4: three blocks, so at most three workers however many cores.
    assert plan_tiles(10, 100, dim, k, 1 << 30, (4, 4096, 1), state, 16).workers == 3
    assert plan_tiles(1, 100, dim, k, 1 << 30, (4, 4096, 1), state, 16).workers == 1
    # A budget for two workers' workspaces keeps two, a byte less halves them before touching the item tile.
    two = TilePlan(1, 100, 1, 2).workspace_bytes(dim, k, state)
    assert plan_tiles(10, 100, dim, k, two, (1, 4096, 1), state, 2) == TilePlan(1, 100, 1, 2)
    assert plan_tiles(10, 100, dim, k, two - 1, (1, 4096, 1), state, 2) == TilePlan(1, 100, 1, 1)


def test_smallest_tile_and_resource_error_numbers():
    dim, k, state = 16, 10, 120
    need = TilePlan(1, 1, 1).workspace_bytes(dim, k, state)
    assert need == 4 + 4 * dim + state
    assert plan_tiles(1000, 1000, dim, k, need, (256, 4096, 1), state) == TilePlan(1, 1, 1)
    with pytest.raises(ResourceError) as info:
        plan_tiles(1000, 1000, dim, k, need - 1, (256, 4096, 1), state)
    msg = str(info.value)
    assert f"{need - 1:,} bytes" in msg and f"{need:,} bytes" in msg
    assert "k=10" in msg and "dim=16" in msg
    with pytest.raises(ResourceError, match=r"budget of 0 bytes"):
        plan_tiles(1, 1, 1, 1, 0, (1, 1, 1), 12)


@given(n_users=st.integers(1, 5000), n_items=st.integers(1, 50_000), dim=st.integers(1, 300),
       k=st.integers(1, 500), budget=st.integers(1, 1 << 26),
       preferred=st.tuples(st.integers(1, 512), st.integers(1, 8192), st.integers(1, 16)), workers=st.integers(1, 64))
@settings(max_examples=200)
def test_property_plan_fits_or_raises(n_users, n_items, dim, k, budget, preferred, workers):
    state = 12 * k
    try:
        plan = plan_tiles(n_users, n_items, dim, k, budget, preferred, state, workers)
    except ResourceError as exc:
        assert budget < TilePlan(1, 1, 1).workspace_bytes(dim, k, state)
        assert re.search(rf"{budget:,} bytes", str(exc))
        return
    assert plan.workspace_bytes(dim, k, state) <= budget
    assert 1 <= plan.user_block <= min(preferred[0], n_users)
    assert 1 <= plan.item_tile <= min(preferred[1], n_items)
    assert 1 <= plan.tiles_per_call <= preferred[2]
    assert 1 <= plan.workers <= workers
    ranges = item_ranges(n_items, plan)
    assert plan.workers <= -(-n_users // plan.user_block) * len(ranges), "a worker with nothing to search"
    segment = plan.item_tile * plan.tiles_per_call  # item ranges: whole segments, in order, covering the items
    assert ranges[0][0] == 0 and ranges[-1][1] == n_items
    assert all(a[1] == b[0] and a[1] % segment == 0 and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
    assert (plan.tiles_per_call - 1) * plan.item_tile < n_items, "no GEMM call needs a whole tile past the end"


@given(n_items=st.integers(1, 3000), item_tile=st.integers(1, 300), tiles=st.integers(1, 9))
@settings(max_examples=300)
def test_item_segments_cover_every_item_once_in_order(n_items, item_tile, tiles):
    plan = TilePlan(1, item_tile, tiles)
    covered = []
    for start, width, n_tiles in item_segments(n_items, plan):
        assert start == len(covered), "segments must be contiguous and in order"
        assert 1 <= width <= item_tile and 1 <= n_tiles <= tiles
        assert start + width * n_tiles <= n_items, "a segment must not run past the last item"
        covered.extend(range(start, start + width * n_tiles))
    assert covered == list(range(n_items))


@pytest.mark.parametrize("n_items, item_tile, tiles, want", [
    (10, 4, 2, [(0, 4, 2), (8, 2, 1)]),
    (8, 4, 2, [(0, 4, 2)]),
    (13, 4, 3, [(0, 4, 3), (12, 1, 1)]),
    (3, 4, 3, [(0, 3, 1)]),
    (9, 2, 8, [(0, 2, 4), (8, 1, 1)]),
])
def test_item_segments_examples(n_items, item_tile, tiles, want):
    assert list(item_segments(n_items, TilePlan(1, item_tile, tiles))) == want


@pytest.mark.parametrize("preferred", [(5, 7, 3), (1, 1, 1), (3, 16, 8), (64, 33, 2)])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_multi_tile_gemm_calls_are_exact(monkeypatch, preferred, metric, make_ties):
    # The CPU backend prefers one tile per call; force several (the GPU's shape of work: one user block against a
    # batch of item tiles, stride 0 on the users) and odd sizes that leave partial blocks and tiles everywhere.
    monkeypatch.setattr(NumpyBackend, "preferred_tiles", lambda self, *shape: preferred)
    monkeypatch.setattr(NumpyBackend, "few_users_area", 0)  # 23 users would widen (64, 33, 2) to one tile
    users, items = make_ties(23, 101, 5, seed=sum(preferred))
    exclude = {0: [0, 1, 2], 7: list(range(50, 101)), 22: list(range(101))}
    engine = Engine(items, metric=metric, device="cpu")
    res = engine.search(users, 12, exclude=exclude)
    want_idx, want_val = oracle.topk(users, items, 12, metric, exclude)
    np.testing.assert_array_equal(res.indices, want_idx)
    np.testing.assert_array_equal(res.scores, want_val.astype(np.float32))


def test_multi_tile_gemm_calls_float(monkeypatch, make_clustered):
    monkeypatch.setattr(NumpyBackend, "preferred_tiles", lambda self, *shape: (17, 64, 5))
    users, items = make_clustered(60, 1000, 24, seed=3)
    res = Engine(items, device="cpu").search(users, 20)
    oracle.assert_topk_close(res.indices, res.scores, users, items, 20)


@pytest.mark.parametrize("n_users, n_items, want", [
    (1, 100_000, 8192),  # 2^18 scores a tile: capped at the widest few-users tile
    (32, 100_000, 8192),
    (100, 100_000, 2048),  # 2^18 // 100 = 2621, down to a power of two
    (1024, 100_000, 512),  # a full block keeps the preferred tile
    (1, 3000, 3000),  # never wider than the catalogue
])
def test_few_users_widen_their_item_tiles(n_users, n_items, want):
    plan = plan_tiles(n_users, n_items, 64, 100, 1 << 30, (1024, 512, 1), 812, few_users_area=1 << 18)
    assert plan.item_tile == want and plan.user_block == min(n_users, 1024)
    assert plan_tiles(n_users, n_items, 64, 100, 1 << 30, (1024, 512, 1), 812).item_tile == min(512, n_items)
    # The budget still applies after widening: tiles halve back to fit.
    tight = plan_tiles(1, 100_000, 64, 100, 4 * 2048 + 4 * 64 + 812, (1024, 512, 1), 812, few_users_area=1 << 18)
    assert tight.item_tile == 2048
    assert WIDEST_FEW_USERS_TILE & (WIDEST_FEW_USERS_TILE - 1) == 0  # a power of two: it divides streamed.ALIGN
    from recall.engine import streamed
    assert streamed.ALIGN % WIDEST_FEW_USERS_TILE == 0


@pytest.mark.parametrize("n_users, want_tiles", [
    (1, 123),  # 2^26 scores a call: every tile of 1M items in one call (one user)
    (32, 123),
    (1024, 8),  # 2^26 // (1024 x 8192)
    (2048, 4),  # a full block keeps the preferred tiling
])
def test_a_backend_batching_tiles_batches_more_for_few_users(n_users, want_tiles):
    # The GPU's preferred tiling (2,048 x 8,192 x 4) and its few_users_area of 2^26 scores: the item tile stays,
    # the tiles per call grow (never past the catalogue), and the budget still applies.
    plan = plan_tiles(n_users, 1_000_000, 64, 100, 1 << 33, (2048, 8192, 4), 812, few_users_area=1 << 26)
    assert (plan.user_block, plan.item_tile, plan.tiles_per_call) == (n_users, 8192, want_tiles)
    tight = plan_tiles(1, 1_000_000, 64, 100, 4 * 8192 * 16 + 4 * 64 + 812, (2048, 8192, 4), 812,
                       few_users_area=1 << 26)
    assert tight.tiles_per_call == 15 and tight.item_tile == 8192  # halved from 123: 61, 30, 15
    assert plan_tiles(1, 1_000_000, 64, 100, 1 << 33, (2048, 8192, 4), 812).tiles_per_call == 4


def test_the_fused_path_declines_fewer_users_than_its_tile():
    # Fewer than a fused kernel's 128 users would pay for the whole tile's products: the cuBLAS path, unless forced.
    import numpy as np

    from recall.backends.cupy import fused

    seeded = TilePlan(127, 8192, 4, 1)
    for dtype in (np.float32, np.float16):
        assert not fused.applies(seeded, 127, 1_000_000, 100, 64, dtype, EngineOptions())
        assert fused.applies(seeded, 127, 1_000_000, 100, 64, dtype, EngineOptions(fused="force"))
        assert fused.applies(TilePlan(128, 8192, 4, 1), 128, 1_000_000, 100, 64, dtype, EngineOptions())
        assert not fused.applies(TilePlan(2048, 8192, 4, 1), 5000, 1_000_000, 100, 64, dtype,
                                 EngineOptions(fused="off"))


def test_a_cpu_search_of_few_users_runs_wide_tiles_unless_pinned_or_off(make_clustered):
    users, items = make_clustered(3, 20_000, 16, seed=4)
    engine = Engine(items, device="cpu")
    res = engine.search(users, 50)
    assert engine.stats["tiles"] == (3, 8192, 1)
    oracle.assert_topk_close(res.indices, res.scores, users, items, 50)
    for options in (EngineOptions(few_user_tiles=False), EngineOptions(tiles=(1024, 512, 1))):
        other = Engine(items, device="cpu", options=options)
        again = other.search(users, 50)
        assert other.stats["tiles"][1] == 512
        np.testing.assert_array_equal(again.indices, res.indices)


@pytest.mark.parametrize("k", [1, 7, 700])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_few_users_on_more_cores_split_the_items_and_merge_exactly(monkeypatch, make_ties, k, metric):
    # 5 users are one block: with 4 workers the block is searched in 4 item ranges (whole segments of 128 items),
    # one task each, merged after. Ties, a user with half the items excluded, one with all, k beyond a range (500
    # items): the oracle's answer, and bit for bit the unsplit search's.
    users, items = make_ties(5, 2000, 6, seed=k)
    exclude = {0: list(range(0, 2000, 2)), 3: list(range(2000))}
    engine = Engine(items, metric=metric, device="cpu", options=EngineOptions(tiles=(64, 64, 2)))
    monkeypatch.setattr(engine.backend, "workers", 4)
    got = engine.search(users, k, exclude=exclude)
    assert engine.stats["item_parts"] == 4 and engine.stats["workers"] == 4
    idx, val = oracle.topk(users, items, k, metric, exclude)
    np.testing.assert_array_equal(got.indices, idx)
    np.testing.assert_array_equal(got.scores, val.astype(np.float32))
    monkeypatch.setattr(engine.backend, "workers", 1)
    want = engine.search(users, k, exclude=exclude)
    assert engine.stats["item_parts"] == 1
    oracle.assert_same_result(got, want)


def test_item_ranges_fit_the_budget_with_their_results():
    # 100 users are one block on 64 workers: 64 ranges would hold 64 x 100 x 8,192 pairs (1 GB) for the merge;
    # under a budget of 32 MB the ranges (and the workers with them) go, whatever else the budget cuts.
    plan = plan_tiles(100, 1_000_000, 64, 8192, 1 << 40, (128, 2048, 1), 12 * 8192, workers=64)
    assert plan.item_parts == 64 and plan.workers == 64
    for budget in (32 << 20, 200 << 20, 600 << 20):
        tight = plan_tiles(100, 1_000_000, 64, 8192, budget, (128, 2048, 1), 12 * 8192, workers=64)
        assert tight.item_parts < 64
        assert tight.workers <= -(-100 // tight.user_block) * tight.item_parts
        assert tight.workspace_bytes(64, 8192, 12 * 8192) + 20 * tight.item_parts * 100 * 8192 <= budget
