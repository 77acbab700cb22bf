"""The tiled search loop both backends share: a user block against every item segment, one strided-batched GEMM per
segment, each segment's scores folded into the running top-k (the GPU's cuBLAS path and the whole CPU backend).

A backend that calls these provides ``xp``, ``gemm_strided_batched(users, items, out)`` and a running top-k
(``topk_new(n_users, k)``, ``topk_reset(state, n_users)``, ``topk_update(state, scores, item_start, n_items,
excl_indptr, excl_items)``, ``topk_result(state)``), and for :func:`run_blocks_threaded` ``asarray``,
``compute_context``, ``merge`` and ``executor()`` (a thread pool of its workers, kept between searches).

Users with several vectors (``TilePlan.interests``) are scored the same way: the block holds every interest row of
its users (``n_users_block * rows`` GEMM rows), and a reduce step folds each user's interest rows into one row
(``xp.maximum`` / ``xp.add`` into a preallocated part of the score buffer) before the top-k update. On the GPU the
reduce launches are captured in the same CUDA graph as the rest of the block.
"""
from __future__ import annotations

import queue
from dataclasses import replace
from typing import Any

from ..core.tiling import InterestPlan, TilePlan, item_segments


#: A ranked threshold sample (``sample_rows`` with ``norms``) keeps every ``even_every``-th of the evenly spaced rows
#: and takes the rest from the items ranked first; 0: all ranked. Which of EVEN_CHOICES a catalogue's samples take is
#: found from its first seeded search's users (``probed_even_every``); EVEN_EVERY without them. Counted on the CPU at
#: k = 50 on 4,096 items (512 sampled, the need's 53rd best; ``python3 scripts/lab/need_counts.py --samples 512
#: --even-every 2,4,8,0``): a half evenly spaced passed 135 scores a user on clustered ip, a quarter 103, none 88;
#: skewed l2 135, 120, 110; popular ip 80, 68, 64; on 100k clustered items at k = 50 from 8,192 rows 119, 104, 88.
#: The evenly spaced rows are the hedge against items whose large norms point away from the users: with an eighth of
#: 4,096 items (normal, d = 32) made ten times as long along one direction, a half passed 593, a quarter 971, none
#: 1,586 (the users opposite them 834, 1,646, 3,537). Timed (H100, docs/benchmarks.md): none evenly spaced took
#: 0.88-0.95x the route's time at k = 50 on 4,096 items, 0.97-0.99x on larger catalogues.
EVEN_EVERY = 2
EVEN_CHOICES = (0, 2)
#: The probe: at most PROBE_USERS users (evenly spaced; fewer than PROBE_LEAST: no probe), their scores against at
#: most PROBE_ITEMS evenly spaced items.
PROBE_USERS = 256
PROBE_LEAST = 64
PROBE_ITEMS = 8192


def sample_rows(xp: Any, n_items: int, size: int, norms: Any = None, even_every: int | None = None) -> Any:
    """The item rows of a threshold sample of ``size`` items (each backend's ``seed_size``): sorted, distinct int64
    of module ``xp``. With stride = n_items // size: every stride-th row, from the middle of the first stride; with
    ``norms`` ((n_items,), where an item's norm bounds its score: the inner product; or any order to rank by), every
    (``even_every`` stride)-th of those rows (half of them at 2, none at 0; None: EVEN_EVERY) and the rest the
    largest norms among the other rows (ties to the lower row). Any rows give a valid seed (the k-th best of real
    items); the largest norms are the items most users rank high, so that their k-th best sits nearer the final k-th
    best and fewer scores pass the filter, and the evenly spread rows keep the seed at least that of a sample of their
    size where norms say little (docs/benchmarks.md: 0.62 -> 0.57 s exact, 0.43 -> 0.34 s fast on 1M users x 100k
    skewed items)."""
    stride = n_items // size
    first = stride // 2
    if norms is None:
        return xp.arange(size, dtype=xp.int64) * stride + first
    even_every = EVEN_EVERY if even_every is None else even_every
    spread = -(-size // even_every) if even_every else 0
    strided = xp.arange(spread, dtype=xp.int64) * (even_every * stride) + first
    rank = xp.array(norms, dtype=xp.float64)
    rank[strided] = -xp.inf
    top = xp.argsort(-rank, kind="stable")[: size - spread].astype(xp.int64)
    return xp.sort(xp.concatenate([strided, top]))


def probed_even_every(xp: Any, users: Any, items: Any, n_items: int, size: int, norms: Any, rank: int) -> int:
    """Which of EVEN_CHOICES a ranked threshold sample (``sample_rows`` with ``norms``) of ``size`` of the first
    ``n_items`` prepared ``items`` should keep evenly spaced, for a search that starts at each user's ``rank``-th
    best of it: the one whose rank-th best lets the fewest scores pass for a probe of the prepared ``users`` (at most
    PROBE_USERS, evenly spaced; their float32 scores against at most PROBE_ITEMS evenly spaced items), ties to
    EVEN_EVERY. Speed only: any rows give a valid seed. EVEN_EVERY (the hedge) where there are fewer than PROBE_LEAST
    users (or rows of another width than the items') or no choice; the backends keep what the first search found for
    the catalogue's later searches (:func:`ranked_rows`)."""
    choices = tuple(dict.fromkeys(EVEN_CHOICES))
    if (users is None or users.shape[0] < PROBE_LEAST or users.shape[1:] != items.shape[1:] or len(choices) < 2
            or not 0 < rank <= size):
        return EVEN_EVERY
    n_users = int(users.shape[0])
    # (copied first: a host array's strided rows, contiguous before they move)
    probe = xp.asarray(users[:: max(1, n_users // PROBE_USERS)][:PROBE_USERS].copy()).astype(xp.float32)
    check = sample_rows(xp, n_items, min(n_items, PROBE_ITEMS))
    scores = probe @ items[check].astype(xp.float32).T
    passed = []
    for every in choices:
        sampled = probe @ items[sample_rows(xp, n_items, size, norms, every)].astype(xp.float32).T
        thr = -xp.partition(-sampled, rank - 1, axis=1)[:, rank - 1]
        passed.append((scores >= thr[:, None]).sum())
    counts = [int(c) for c in xp.stack(passed).tolist()]  # one copy to the host
    if EVEN_EVERY in choices and counts[choices.index(EVEN_EVERY)] == min(counts):
        return EVEN_EVERY
    return choices[counts.index(min(counts))]


def ranked_rows(xp: Any, users: Any, items: Any, n_items: int, size: int, norms: Any, rank: int) -> tuple[Any, int]:
    """A ranked threshold sample's rows (``sample_rows`` with ``norms``) and how many of them it keeps evenly spaced
    (:func:`probed_even_every` of ``users``): each backend's sample of a catalogue, made once."""
    every = probed_even_every(xp, users, items, n_items, size, norms, rank)
    return sample_rows(xp, n_items, size, norms, every), every


def search_block(backend: Any, plan: TilePlan, users: Any, items: Any, n_items: int, state: Any, scores_buf: Any,
                 excl_indptr: Any, excl_items: Any, item_range: tuple[int, int] | None = None) -> None:
    """Score one user block (n, dim) against every item (or the rows ``item_range`` of them, starting on a segment
    boundary) and fold the scores into ``state`` (already reset)."""
    if plan.interests is not None:
        _search_block_interests(backend, plan, plan.interests, users, items, n_items, state, scores_buf,
                                excl_indptr, excl_items)
        return
    n, dim = users.shape
    users_batch = users.reshape(1, n, dim)
    lo, hi = item_range or (0, n_items)
    for start, width, tiles in item_segments(hi - lo, plan):
        start += lo
        segment = items[start:start + width * tiles].reshape(tiles, width, dim)
        scores = scores_buf[: tiles * n * width].reshape(tiles, n, width)
        backend.gemm_strided_batched(users_batch, segment, scores)
        backend.topk_update(state, scores, start, n_items, excl_indptr, excl_items)


def _search_block_interests(backend: Any, plan: TilePlan, ip: InterestPlan, users: Any, items: Any, n_items: int,
                            state: Any, scores_buf: Any, excl_indptr: Any, excl_items: Any) -> None:
    """:func:`search_block` for a block of ``n`` users given as ``(n, rows * dim)``: every interest row scored,
    then reduced to one row per user (max or sum; for l2 + max each interest's bias taken off first)."""
    xp = backend.xp
    n = int(users.shape[0])
    dim = int(items.shape[1])
    m, rows = ip.m, ip.rows
    users_batch = users.reshape(1, n * rows, dim)
    bias = users.reshape(n, rows * dim)[:, m * dim:m * dim + m] if ip.bias else None  # (n, m) view
    op = xp.maximum if ip.aggregate == "max" else xp.add
    for start, width, tiles in item_segments(n_items, replace(plan, item_tile=ip.width, interests=None)):
        segment = items[start:start + width * tiles].reshape(tiles, width, dim)
        n_raw = tiles * n * rows * width
        raw = scores_buf[:n_raw].reshape(tiles, n * rows, width)
        backend.gemm_strided_batched(users_batch, segment, raw)
        per_user = raw.reshape(tiles, n, rows, width)
        if bias is not None:
            # One view object for input and output: an in-place ufunc then neither copies nor allocates (CuPy
            # copies an input that overlaps the output unless it is the output), which CUDA graph capture needs.
            real = per_user[:, :, :m]
            xp.subtract(real, bias[None, :, :, None], out=real)
        out = scores_buf[n_raw:n_raw + tiles * n * width].reshape(tiles, n, width)
        # Interest by interest, in a fixed order: float32 sums come out the same on every backend.
        op(per_user[:, :, 0], per_user[:, :, 1], out=out)
        for j in range(2, m):
            op(out, per_user[:, :, j], out=out)
        backend.topk_update(state, out, start, n_items, excl_indptr, excl_items)


def run_blocks_threaded(backend: Any, plan: TilePlan, users: Any, items: Any, n_items: int, k: int, excl: Any,
                        out_vals: Any, out_rows: Any, seed: Any = None) -> None:
    """Search every user block, writing each block's top-k into rows of ``out_vals`` / ``out_rows``.

    ``plan.workers`` tasks run at once (one per CPU core), each with its own top-k state and score buffer, taken
    from a pool so that nothing is allocated per block. A task is a user block, or, where the plan cuts the items
    in ``plan.item_parts`` ranges (fewer blocks than cores), a block against one range; the ranges' results are
    merged afterwards (``backend.merge``: ties to the lower row, as in one pass). With a threshold sample ``seed``
    (whole-catalogue searches only), each block's reset state is seeded first: ``backend.seed_scratch(seed,
    user_block)`` per workspace, ``backend.topk_seed(state, users, seed, scratch, excl_indptr, excl_items)``.
    """
    xp = backend.xp
    n_users = users.shape[0]
    blocks = [(start, min(start + plan.user_block, n_users)) for start in range(0, n_users, plan.user_block)]
    ranges = item_ranges(n_items, plan) if plan.interests is None else [(0, n_items)]
    split = len(ranges) > 1
    if split:
        seed = None  # a range's own k-th best may lie below the whole catalogue's sample's
    parts = [(xp.empty((n_users, k), xp.float32), xp.empty((n_users, k), xp.int64)) for _ in ranges] if split \
        else [(out_vals, out_rows)]
    tasks = [(block, r) for block in blocks for r in range(len(ranges))]
    workers = max(1, min(plan.workers, len(tasks)))
    workspaces: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(workers):
        workspaces.put((backend.topk_new(plan.user_block, k),
                        xp.empty(plan.user_block * plan.item_tile * plan.tiles_per_call, dtype=xp.float32),
                        None if seed is None else backend.seed_scratch(seed, plan.user_block)))

    def one(task: tuple[tuple[int, int], int]) -> None:
        (start, stop), r = task
        workspace = workspaces.get()
        state, scores_buf, scratch = workspace
        try:
            ptr, excluded = excl.block(start, stop)
            ptr, excluded = backend.asarray(ptr), backend.asarray(excluded)
            backend.topk_reset(state, stop - start)
            if seed is not None:
                backend.topk_seed(state, users[start:stop], seed, scratch, ptr, excluded)
            search_block(backend, plan, users[start:stop], items, n_items, state, scores_buf, ptr, excluded,
                         ranges[r] if split else None)
            vals, rows = backend.topk_result(state)
            part_vals, part_rows = parts[r]
            part_vals[start:stop, :k] = vals
            part_rows[start:stop, :k] = rows
        finally:
            workspaces.put(workspace)

    with backend.compute_context():
        if workers == 1:
            for task in tasks:
                one(task)
        else:
            # At most `workers` tasks at a time: each takes a workspace from the queue, which holds that many.
            for _ in backend.executor().map(one, tasks):
                pass
    if split:
        vals, rows = backend.merge([(v, r, 0) for v, r in parts], k)
        out_vals[:, :k] = vals
        out_rows[:, :k] = rows


def item_ranges(n_items: int, plan: TilePlan) -> list[tuple[int, int]]:
    """The ``plan.item_parts`` item ranges a block is searched in: whole segments of ``item_tile * tiles_per_call``
    rows each (the last range ends at ``n_items``), so that every GEMM is the one the unsplit search makes."""
    segment = plan.item_tile * plan.tiles_per_call
    n_segments = -(-n_items // segment)
    n_parts = max(1, min(plan.item_parts, n_segments))
    bounds = [p * n_segments // n_parts * segment for p in range(n_parts)] + [n_items]
    return [(bounds[p], min(bounds[p + 1], n_items)) for p in range(n_parts)]
