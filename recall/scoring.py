"""Scoring over tiles: how a search is cut into strided-batched GEMMs that fit the memory budget.

A search visits users in blocks and, for each block, the items in segments of ``tiles_per_call`` tiles of
``item_tile`` rows; one strided-batched GEMM scores a whole segment (the user block is shared by every tile of the
batch: stride 0), and the segment's scores go straight into the running top-k.
"""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Iterator

from .errors import ResourceError


@dataclass(frozen=True)
class TilePlan:
    user_block: int
    item_tile: int
    tiles_per_call: int
    workers: int = 1  # blocks searched at once, each holding its own workspace
    interests: Any = None  # recall.interests.InterestPlan: several rows per user, reduced to one before the top-k

    def workspace_bytes(self, dim: int, k: int, state_bytes_per_user: int) -> int:
        """Bytes of working memory the search holds: per worker, the score tiles, the user block and the top-k."""
        scores = 4 * self.user_block * self.item_tile * self.tiles_per_call
        users = 4 * self.user_block * dim
        return self.workers * (scores + users + self.user_block * state_bytes_per_user)


def plan_tiles(n_users: int, n_items: int, dim: int, k: int, budget: int, preferred: tuple[int, int, int],
               state_bytes_per_user: int, workers: int = 1) -> TilePlan:
    """The largest tiling at most ``preferred`` whose workspace fits in ``budget`` bytes.

    Shrinks the number of tiles per call first, then the item tile (to 256), then the user block, then the number
    of concurrent workers, then the item tile to 1, halving each.

    Raises
    ------
    ResourceError
        If even one user against one item does not fit.
    """
    pref_users, pref_tile, pref_tiles = preferred
    user_block = max(1, min(pref_users, n_users))
    item_tile = max(1, min(pref_tile, n_items))
    tiles = max(1, min(pref_tiles, -(-n_items // item_tile)))
    workers = max(1, min(workers, -(-n_users // user_block)))
    plan = TilePlan(user_block, item_tile, tiles, workers)
    while plan.workspace_bytes(dim, k, state_bytes_per_user) > budget:
        if plan.tiles_per_call > 1:
            plan = replace(plan, tiles_per_call=plan.tiles_per_call // 2)
        elif plan.item_tile > 256:
            plan = replace(plan, item_tile=plan.item_tile // 2)
        elif plan.user_block > 1:
            plan = replace(plan, user_block=plan.user_block // 2)
        elif plan.workers > 1:
            plan = replace(plan, workers=plan.workers // 2)
        elif plan.item_tile > 1:
            plan = replace(plan, item_tile=plan.item_tile // 2)
        else:
            need = plan.workspace_bytes(dim, k, state_bytes_per_user)
            raise ResourceError(
                f"memory budget of {budget:,} bytes is too small: one user against one item with k={k} and "
                f"dim={dim} needs {need:,} bytes of workspace"
            )
    return plan


def item_segments(n_items: int, plan: TilePlan) -> Iterator[tuple[int, int, int]]:
    """(first item row, tile width, number of tiles) for each GEMM call that covers ``n_items`` rows in order."""
    start = 0
    full = plan.item_tile * plan.tiles_per_call
    while start < n_items:
        rest = n_items - start
        if rest >= full:
            width, tiles = plan.item_tile, plan.tiles_per_call
        elif rest >= plan.item_tile:
            width, tiles = plan.item_tile, rest // plan.item_tile
        else:
            width, tiles = rest, 1
        yield start, width, tiles
        start += width * tiles


def search_block(backend: Any, plan: TilePlan, users: Any, items: Any, n_items: int, state: Any, scores_buf: Any,
                 excl_indptr: Any, excl_items: Any) -> None:
    """Score one user block (n, dim) against every item and fold the scores into ``state`` (already reset)."""
    if plan.interests is not None:
        return plan.interests.search_block(backend, plan, users, items, n_items, state, scores_buf, excl_indptr,
                                           excl_items)
    n, dim = users.shape
    users_batch = users.reshape(1, n, dim)
    for start, width, tiles in item_segments(n_items, plan):
        segment = items[start:start + width * tiles].reshape(tiles, width, dim)
        scores = scores_buf[: tiles * n * width].reshape(tiles, n, width)
        backend.gemm_strided_batched(users_batch, segment, scores)
        backend.topk_update(state, scores, start, n_items, excl_indptr, excl_items)


def run_blocks(backend: Any, plan: TilePlan, users: Any, items: Any, n_items: int, k: int, excl: Any,
               out_vals: Any, out_rows: Any) -> None:
    """Search every user block, writing each block's top-k into rows of ``out_vals`` / ``out_rows``.

    ``backend.workers`` blocks run at once (one per CPU core on the CPU; one on a GPU, which overlaps its work on
    streams instead), each with its own top-k state and score buffer, taken from a pool so that nothing is allocated
    per block.
    """
    n_users = users.shape[0]
    blocks = [(start, min(start + plan.user_block, n_users)) for start in range(0, n_users, plan.user_block)]
    workers = max(1, min(plan.workers, len(blocks)))
    workspaces: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(workers):
        workspaces.put((backend.topk_new(plan.user_block, k),
                        backend.xp.empty(plan.user_block * plan.item_tile * plan.tiles_per_call,
                                         dtype=backend.xp.float32)))

    def one(block: tuple[int, int]) -> None:
        start, stop = block
        state, scores_buf = workspaces.get()
        try:
            ptr, excluded = excl.block(start, stop)
            backend.topk_reset(state, stop - start)
            search_block(backend, plan, users[start:stop], items, n_items, state, scores_buf,
                         backend.asarray(ptr), backend.asarray(excluded))
            vals, rows = backend.topk_result(state)
            out_vals[start:stop, :k] = vals
            out_rows[start:stop, :k] = rows
        finally:
            workspaces.put((state, scores_buf))

    with backend.compute_context():
        if workers == 1:
            for block in blocks:
                one(block)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="recall") as pool:
                for _ in pool.map(one, blocks):
                    pass
