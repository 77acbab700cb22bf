"""Tiling plans: how a search is cut into user blocks and item segments that fit the memory budget.

A search visits users in blocks and, for each block, the items in segments of ``tiles_per_call`` tiles of
``item_tile`` rows; one strided-batched GEMM scores a whole segment (the user block is shared by every tile of the
batch: stride 0), and the segment's scores go straight into the running top-k. This module only plans; the loops
that run a plan are the backends' (``recall.backends.tiled``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from .errors import ResourceError


@dataclass(frozen=True)
class InterestPlan:
    """How a block's user rows fold into users, for users with several vectors (``TilePlan.interests``).

    Attributes
    ----------
    m : int
        Interest rows per user (ragged users padded to it).
    rows : int
        User rows per user in the block: ``m``, plus the bias rows of l2 + max.
    aggregate : {"max", "sum"}
    bias : bool
        Whether row ``m`` holds each interest's ``||u_i||²/2``, subtracted before the maximum (l2 + max).
    width : int
        Items per score tile. The plan's score buffer holds ``item_tile`` floats per user and tile; ``rows`` of
        them hold the GEMM output and one the reduced scores, so ``width = item_tile // (rows + 1)``.
    """

    m: int
    rows: int
    aggregate: str
    bias: bool
    width: int


@dataclass(frozen=True)
class TilePlan:
    user_block: int
    item_tile: int
    tiles_per_call: int
    workers: int = 1  # blocks searched at once, each holding its own workspace
    interests: "InterestPlan | None" = None  # several rows per user, reduced to one before the top-k
    # Item ranges each user block is searched in, one task each, merged afterwards: more workers than blocks (few
    # users) would leave cores idle (the CPU; on whole segments, so each GEMM is the unsplit search's).
    item_parts: int = 1

    def workspace_bytes(self, dim: int, k: int, state_bytes_per_user: int) -> int:
        """Bytes of working memory the search holds: per worker, the score tiles, the user block and the top-k."""
        scores = 4 * self.user_block * self.item_tile * self.tiles_per_call
        users = 4 * self.user_block * dim
        return self.workers * (scores + users + self.user_block * state_bytes_per_user)


#: Users per block below which a search's blocks are not split further to give every worker one.
_MIN_SPLIT_BLOCK = 128
#: Bytes a user's pair holds while item ranges wait for their merge: a float32 score and an int64 row, then the
#: merge's 8-byte key.
_PART_BYTES = 20
#: The widest item tile a block of few users widens to (``few_users_area``): a power of two dividing the streamed
#: engine's segment alignment (``recall.engine.streamed.ALIGN``), so that a streamed search's GEMMs keep the shapes
#: of the resident search's and its scores the same bits.
WIDEST_FEW_USERS_TILE = 8192


def plan_tiles(n_users: int, n_items: int, dim: int, k: int, budget: int, preferred: tuple[int, int, int],
               state_bytes_per_user: int, workers: int = 1, few_users_area: int = 0) -> TilePlan:
    """The largest tiling at most ``preferred`` whose workspace fits in ``budget`` bytes.

    ``few_users_area`` (``Backend.few_users_area``; 0: off): a search of fewer users than the preferred block takes
    item tiles as wide as score tiles of that many scores allow (a power of two, at most
    :data:`WIDEST_FEW_USERS_TILE`), before the budget is applied: where each tile costs a call and a selection pass
    of its own (the CPU), one user against 100,000 items then runs 13 tiles instead of 196. A backend that batches
    several tiles a GEMM call (preferred tiles per call > 1: the GPU) also batches more tiles a call, up to that many
    scores: one user against 1M items is then one call, not 31.

    Shrinks the number of tiles per call first, then the item tile (to 256), then the user block, then the number
    of concurrent workers, then the item tile to 1, halving each; except that while a block's top-k state takes more
    bytes than its score tiles (large k), the user block halves first: a narrow tile costs a launch per few hundred
    items, and on the GPU the item tiles a call holds are also the room for the threshold sample (k = 8,192 on
    10k x 1M x 64: seeded from 65,536 items in 2,048 x 16,384 x 4, 0.115 s; unseeded in 2,048 x 8,192 x 1, where
    the tiles per call had halved first, 0.173 s), while a smaller block only means more blocks. Before that,
    with several workers, the user block is halved (down to 128 users) until every worker has a block: a few
    hundred users still use every core.
    Where there are still fewer blocks than workers, each block is searched in ``item_parts`` ranges of the items
    (whole GEMM segments each), one task a worker, merged afterwards.

    Raises
    ------
    ResourceError
        If even one user against one item does not fit.
    """
    pref_users, pref_tile, pref_tiles = preferred
    user_block = max(1, min(pref_users, n_users))
    while workers > 1 and user_block > _MIN_SPLIT_BLOCK and -(-n_users // user_block) < workers:
        user_block //= 2
    if few_users_area and user_block < pref_users:
        wide = 1 << max(0, (few_users_area // user_block).bit_length() - 1)  # a power of two
        pref_tile = max(pref_tile, min(wide, WIDEST_FEW_USERS_TILE))
        if pref_tiles > 1:  # a backend batching tiles in its GEMM calls (the GPU) batches more of them
            pref_tiles = max(pref_tiles, few_users_area // (user_block * pref_tile))
    item_tile = max(1, min(pref_tile, n_items))
    tiles = max(1, min(pref_tiles, -(-n_items // item_tile)))
    blocks = -(-n_users // user_block)
    # Fewer blocks than workers: each block is searched in item ranges of whole segments, one a worker.
    item_parts = max(1, min(workers // blocks, -(-n_items // (item_tile * tiles)))) if workers > blocks else 1
    workers = max(1, min(workers, blocks * item_parts))
    plan = TilePlan(user_block, item_tile, tiles, workers, item_parts=item_parts)
    while plan.workspace_bytes(dim, k, state_bytes_per_user) > budget:
        if plan.user_block > 1 and 4 * plan.item_tile * plan.tiles_per_call < state_bytes_per_user:
            plan = replace(plan, user_block=plan.user_block // 2)
        elif plan.tiles_per_call > 1:
            plan = replace(plan, tiles_per_call=plan.tiles_per_call // 2)
        elif plan.item_tile > 256 and (plan.user_block == 1 or 4 * plan.item_tile >= state_bytes_per_user):
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
    # The item ranges' results wait for their merge: k (score, row) pairs a user and range, and the merge's keys.
    while plan.item_parts > 1 and (plan.workspace_bytes(dim, k, state_bytes_per_user)
                                   + _PART_BYTES * plan.item_parts * n_users * k > budget):
        plan = replace(plan, item_parts=plan.item_parts // 2)
    if plan.item_parts > 1 or plan.workers > blocks:
        plan = replace(plan, workers=max(1, min(plan.workers, -(-n_users // plan.user_block) * plan.item_parts)))
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
