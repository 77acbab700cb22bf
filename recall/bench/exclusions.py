"""Per-user exclusions of a benchmark workload ("never return these items to this user": already seen, bought).

Exclusions live as CSR over user rows (:class:`Exclusions`), on the device of the data (NumPy, or CuPy for GPU runs,
generated there). Every user gets ``per_user`` excluded items, chosen to matter for correctness, not only for cost:

- a quarter of them (``HOT_FRACTION``, at most k / 2) are the user's best items on a strided sample of the catalogue
  (the sample's top items are near the top of the full catalogue, so many are among the user's true top-k);
- the rest are uniformly random items, distinct per user;
- and, once the oracle has the users it checks (:func:`plant`), a share of each checked user's list is replaced by
  items of its TRUE top-k, the best and the k-th among them: a contender that ignores or misapplies exclusions then
  cannot pass the check.

Per-user lists are sorted and free of duplicates, so a user may have a few fewer than ``per_user`` (where the hot and
random picks met). This module also holds what each contender family does with exclusions, as their users would
write it: the per-query bitmap of cuVS (:func:`bitmap_into`, built on the device), the over-fetch post-filter of
FAISS (:func:`post_filter`) and the (row, item) pairs a torch mask is built from (:meth:`Exclusions.entries`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recall import InputError

from .rng import Rng, candidate_rows

HOT_FRACTION = 0.25
"""Share of each user's exclusions taken from its best items on a sample of the catalogue."""
HOT_SAMPLE = {"cpu": 8_192, "gpu": 65_536}
"""Items in the strided catalogue sample the hot exclusions are picked from (the GPU can afford a larger one)."""
PLANT_MAX = 16
"""Most true top-k items planted in one checked user's exclusions."""
_SCORE_BYTES = {"cpu": 128 << 20, "gpu": 1 << 30}
"""Bytes of one block of float32 sample scores while picking hot exclusions."""


def _module(arr: Any) -> Any:
    if type(arr).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


@dataclass
class Exclusions:
    """Excluded item rows per user, as CSR: user ``u`` excludes ``items[indptr[u]:indptr[u + 1]]``, sorted, unique.

    Attributes
    ----------
    indptr : array of int64, shape (n_users + 1,)
        NumPy, or CuPy on the device.
    items : array of int64, shape (nnz,)
        Same device as ``indptr``.
    n_items : int
        Size of the catalogue (every item row is below it).
    per_user : int
        The nominal count per user (each user has at most this many).
    """

    indptr: Any
    items: Any
    n_items: int
    per_user: int
    _host: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    _max: int | None = field(default=None, repr=False)

    @property
    def xp(self) -> Any:
        return _module(self.indptr)

    @property
    def n_users(self) -> int:
        return int(self.indptr.shape[0]) - 1

    @property
    def nnz(self) -> int:
        return int(self.items.shape[0])

    @property
    def max_per_user(self) -> int:
        """The largest list (what FAISS must over-fetch by)."""
        if self._max is None:
            self._max = int(self.xp.diff(self.indptr).max()) if self.n_users else 0
        return self._max

    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """(indptr, items) as NumPy int64, the CSR pair ``recall.Engine.search(exclude=...)`` takes; copied from the
        device once and kept."""
        if self._host is None:
            if self.xp is np:
                self._host = (self.indptr, self.items)
            else:
                self._host = (self.indptr.get(), self.items.get())
        return self._host

    def for_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Host CSR (indptr (len(rows) + 1,), items) of the users ``rows``, in that order (gathered on the device)."""
        xp = self.xp
        rows_x = xp.asarray(np.asarray(rows, dtype=np.int64))
        counts = self.indptr[rows_x + 1] - self.indptr[rows_x]
        indptr = xp.zeros(rows_x.size + 1, dtype=xp.int64)
        xp.cumsum(counts, out=indptr[1:])
        nnz = int(indptr[-1])
        if nnz == 0:
            items = xp.zeros(0, dtype=xp.int64)
        else:
            # Position of every gathered entry in ``items``: its user's start plus its rank within the user.
            owner = xp.searchsorted(indptr, xp.arange(nnz), side="right") - 1
            items = self.items[self.indptr[rows_x][owner] + xp.arange(nnz) - indptr[owner]]
        return _to_host(indptr), _to_host(items)

    def block(self, start: int, stop: int) -> tuple[Any, Any]:
        """(indptr (stop - start + 1,), items) of users ``start:stop``, re-based to 0, on the CSR's device."""
        ptr = self.indptr[start:stop + 1]
        a, b = int(ptr[0]), int(ptr[-1])
        return ptr - a, self.items[a:b]

    def entries(self, start: int, stop: int) -> tuple[Any, Any]:
        """(row within the block, item row) of every exclusion of users ``start:stop``, on the CSR's device: what a
        dense mask of the block (``mask[rows, items] = True``) is built from."""
        xp = self.xp
        ptr, items = self.block(start, stop)
        rows = xp.searchsorted(ptr, xp.arange(items.shape[0]), side="right") - 1
        return rows.astype(xp.int64), items

    def keys(self, start: int, stop: int) -> Any:
        """Sorted int64 keys ``row_in_block * n_items + item`` of users ``start:stop`` (a searchsorted-able set)."""
        rows, items = self.entries(start, stop)
        return rows * self.n_items + items


def _to_host(arr: Any) -> np.ndarray:
    return arr if isinstance(arr, np.ndarray) else arr.get()


def _csr_from_sorted_rows(xp: Any, picks: Any, n_items: int, per_user: int) -> Exclusions:
    """CSR from (n_users, m) item rows sorted within each row, dropping repeats within a row."""
    n_users = picks.shape[0]
    keep = xp.ones(picks.shape, dtype=bool)
    if picks.shape[1] > 1:
        keep[:, 1:] = picks[:, 1:] != picks[:, :-1]
    indptr = xp.zeros(n_users + 1, dtype=xp.int64)
    xp.cumsum(keep.sum(axis=1), out=indptr[1:])
    return Exclusions(indptr, xp.ascontiguousarray(picks[keep]).astype(xp.int64), int(n_items), int(per_user))


def from_lists(lists: list[Any], n_items: int, xp: Any = np) -> Exclusions:
    """Exclusions from one iterable of item rows per user (tests, users' own lists).

    Raises
    ------
    InputError
        On an item row outside [0, n_items).
    """
    rows = [np.unique(np.asarray(list(x), dtype=np.int64)) for x in lists]
    for u, r in enumerate(rows):
        if r.size and (r[0] < 0 or r[-1] >= n_items):
            raise InputError(f"exclusions: user row {u} has an item row outside [0, {n_items})")
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([r.size for r in rows], out=indptr[1:])
    items = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    per = int(max((r.size for r in rows), default=0))
    return Exclusions(xp.asarray(indptr), xp.asarray(items), int(n_items), per)


def _sample_scores(xp: Any, metric: str, u: Any, v: Any, v_sq: Any) -> Any:
    """float32 scores (metric order) of users ``u`` against sample items ``v`` (v_sq: their squared norms)."""
    s = u @ v.T
    if metric == "cosine":
        s /= xp.sqrt(xp.maximum(v_sq, xp.float32(1e-30)))[None, :]
    elif metric == "l2":
        s *= 2
        s -= v_sq[None, :]
    return s


def _top_columns(xp: Any, s: Any, h: int) -> Any:
    """(n, h) column positions of the h largest entries of each row of ``s`` (any order; ``s`` is overwritten)."""
    if xp is np:
        return np.argpartition(-s, h - 1, axis=1)[:, :h]
    # CuPy's argpartition sorts the whole row; h passes of argmax are much cheaper for the few hot picks.
    out = xp.empty((s.shape[0], h), dtype=xp.int64)
    rows = xp.arange(s.shape[0])
    for j in range(h):
        col = xp.argmax(s, axis=1)
        out[:, j] = col
        s[rows, col] = -xp.inf
    return out


def generate(users: Any, items: Any, per_user: int, k: int = 100, seed: int = 0, metric: str = "ip",
             hot_fraction: float = HOT_FRACTION) -> Exclusions:
    """Seeded exclusions: ``per_user`` items per user, a share of them among the user's best (module docstring).

    Parameters
    ----------
    users : array of float32, shape (n_users, dim)
        NumPy, or CuPy (then everything is generated on the device).
    items : array of float32, shape (n_items, dim)
        Same device as ``users``.
    per_user : int
        Exclusions per user, 1 <= per_user < n_items.
    k : int
        The workload's k: the catalogue sample is large enough that its best items are likely in the true top-k.
    seed : int
    metric : {"ip", "cosine", "l2"}
        The order "best" is judged in.
    hot_fraction : float
        Share of the hot picks, in [0, 1].

    Returns
    -------
    Exclusions
        On the users' device.

    Raises
    ------
    InputError
        ``per_user`` out of range or a bad ``hot_fraction``.
    """
    xp = _module(users)
    n_users, n_items = int(users.shape[0]), int(items.shape[0])
    if isinstance(per_user, bool) or not isinstance(per_user, (int, np.integer)) or not 1 <= per_user < n_items:
        raise InputError(f"exclusions per user must be an integer in [1, {n_items}), got {per_user!r}")
    if not 0.0 <= hot_fraction <= 1.0:
        raise InputError(f"hot_fraction must be in [0, 1], got {hot_fraction!r}")
    device = "cpu" if xp is np else "gpu"
    # At most half of k: exclusions should take some of a user's top-k away, not (on a small catalogue) all of it.
    hot = min(per_user, int(round(per_user * hot_fraction)), max(1, k // 2))
    parts = []
    if hot:
        # A strided sample covers the whole catalogue evenly, ordered kinds (adversarial) included; at n_items / k
        # sampled items per true top-k item, the sample's best items are about as good as the user's true top-k.
        want = min(n_items, HOT_SAMPLE[device], max(16 * hot, 16 * n_items // max(1, k)))
        step = max(1, n_items // want)
        rng = Rng(np, int(np.random.SeedSequence([int(seed), 0xE8C1]).generate_state(1)[0]))
        offset = int(rng.integers(0, step, (1,))[0])
        sample = xp.arange(offset, n_items, step, dtype=xp.int64)[:want]
        v = items[sample]
        v_sq = xp.einsum("ij,ij->i", v, v)
        h = min(hot, int(sample.shape[0]))
        picks = xp.empty((n_users, h), dtype=xp.int64)
        block = max(1, _SCORE_BYTES[device] // (4 * int(sample.shape[0])))
        for a in range(0, n_users, block):
            b = min(a + block, n_users)
            s = _sample_scores(xp, metric, users[a:b], v, v_sq)
            picks[a:b] = sample[_top_columns(xp, s, h)]
            del s
        parts.append(picks)
    if per_user - hot > 0:
        parts.append(candidate_rows(n_users, n_items, per_user - hot, seed=seed + 0x51, device=device))
    allp = parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=1)
    return _csr_from_sorted_rows(xp, xp.sort(allp, axis=1), n_items, per_user)


def plant(excl: Exclusions, rows: np.ndarray, top_items: np.ndarray, seed: int = 0) -> Exclusions:
    """``excl`` with part of each checked user's list replaced by items of its true top-k.

    Parameters
    ----------
    excl : Exclusions
    rows : array of int64, shape (n_sample,)
        The checked users.
    top_items : array of int64, shape (n_sample, k_eff)
        Their true top items without exclusions, best first (``oracle.Truth.top_items``); -1 entries are ignored.
        Up to a quarter of them (at most ``PLANT_MAX``, at least the best and the k-th) are planted.
    seed : int
        Which of the old entries make room.

    Returns
    -------
    Exclusions
        A new CSR on ``excl``'s device; every user keeps at most ``excl.per_user`` items. The planted items are
        spread over the top-k and always include the best and the k-th.
    """
    xp = excl.xp
    rows = np.asarray(rows, dtype=np.int64)
    old_ptr, old_items = excl.for_rows(rows)
    k_eff = top_items.shape[1]
    # A quarter of the top-k at most (the best and the k-th always): the rest of it stays to be found.
    m = min(max(1, excl.per_user // 2), max(2, k_eff // 4), PLANT_MAX)
    positions = np.unique(np.round(np.linspace(0, k_eff - 1, m)).astype(np.int64))
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x91A7]))
    new_users, new_items = [], []
    for j, user in enumerate(rows):
        chosen = top_items[j, positions]
        chosen = np.unique(chosen[chosen >= 0])
        old = old_items[old_ptr[j]:old_ptr[j + 1]]
        old = old[~np.isin(old, chosen)]
        room = max(0, excl.per_user - chosen.size)
        if old.size > room:
            old = old[rng.permutation(old.size)[:room]]
        mine = np.union1d(chosen, old)
        new_users.append(np.full(mine.size, user, np.int64))
        new_items.append(mine)
    planted = np.concatenate(new_users) * excl.n_items + np.concatenate(new_items) if rows.size \
        else np.zeros(0, np.int64)

    # Rebuild the whole CSR on its device: every other user's entries as keys, plus the checked users' new lists.
    n_users, nnz = excl.n_users, excl.nnz
    owner = xp.searchsorted(excl.indptr, xp.arange(nnz), side="right") - 1
    checked = xp.zeros(n_users, dtype=bool)
    checked[xp.asarray(rows)] = True
    keep = ~checked[owner]
    keys = xp.concatenate([owner[keep] * excl.n_items + excl.items[keep], xp.asarray(planted)])
    keys = xp.sort(keys)
    user_of = keys // excl.n_items
    indptr = xp.zeros(n_users + 1, dtype=xp.int64)
    xp.cumsum(xp.bincount(user_of, minlength=n_users), out=indptr[1:])
    return Exclusions(indptr, keys - user_of * excl.n_items, excl.n_items, excl.per_user)


# --- what each contender family does with exclusions ------------------------------------------------------------


def post_filter(excl: Exclusions, start: int, indices: Any, scores: Any, k: int) -> tuple[Any, Any]:
    """Drop excluded items from an over-fetched answer and keep the first ``k`` that remain (FAISS's way).

    Parameters
    ----------
    excl : Exclusions
    start : int
        Row of the answer's first user (the answer holds users ``start:start + len(indices)``).
    indices : array of int64, shape (n, k_fetch)
        Item rows best first, -1 = none; same device as ``excl``.
    scores : array of float32, shape (n, k_fetch)
    k : int
        Items to keep per user; fewer remain where the over-fetch was short (padded with -1 / -inf).

    Returns
    -------
    (indices, scores) : arrays of shape (n, k)
    """
    xp = excl.xp
    n, k_fetch = indices.shape
    keys = excl.keys(start, start + n)
    valid = indices >= 0
    ask = xp.arange(n, dtype=xp.int64)[:, None] * excl.n_items + xp.where(valid, indices, 0)
    if keys.shape[0]:
        pos = xp.minimum(xp.searchsorted(keys, ask.ravel()), keys.shape[0] - 1).reshape(ask.shape)
        valid &= keys[pos] != ask
    # Each surviving slot moves to its rank among the row's survivors: order is kept, the first k survive.
    rank = xp.cumsum(valid, axis=1) - 1
    take = valid & (rank < k)
    out_i = xp.full((n, k), -1, dtype=xp.int64)
    out_s = xp.full((n, k), -xp.inf, dtype=xp.float32)
    r, c = xp.nonzero(take)
    out_i[r, rank[r, c]] = indices[r, c]
    out_s[r, rank[r, c]] = scores[r, c]
    return out_i, out_s


def bitmap_words(n_users: int, n_items: int) -> int:
    """uint32 words of a per-query bitmap of ``n_users`` x ``n_items`` bits."""
    return -(-(int(n_users) * int(n_items)) // 32)


def allow_bitset(allow: np.ndarray, n_items: int) -> np.ndarray:
    """cuVS's shared filter (``filters.from_bitset``) of an allow-set of item rows: bit ``j`` (least significant
    first within each uint32 word) 1 where row ``j`` is allowed. Built on the host (``n_items / 8`` bytes)."""
    rows = np.asarray(allow, dtype=np.int64)
    bits = np.zeros(-(-int(n_items) // 32), dtype=np.uint32)
    np.bitwise_or.at(bits, rows >> 5, (np.uint32(1) << (rows & 31).astype(np.uint32)))
    return bits


def bitmap_into(buf: Any, excl: Exclusions, start: int, stop: int) -> Any:
    """The cuVS per-query bitmap of users ``start:stop``, built on the device in ``buf``: bit ``j`` of query ``i`` at
    position ``i * n_items + j``, least significant bit first within each uint32 word, 1 = allowed.

    Parameters
    ----------
    buf : array of uint32, shape (>= bitmap_words(stop - start, n_items),)
        Reused scratch on ``excl``'s device (CuPy for cuVS; NumPy works too, for tests); the bitmap is its leading
        words. On the GPU it works on the current CuPy stream.
    excl : Exclusions
    start, stop : int
        The users of the batch.

    Returns
    -------
    array of uint32, shape (bitmap_words(stop - start, n_items),)
        A view of ``buf``.
    """
    xp = excl.xp
    n_bits = (stop - start) * excl.n_items
    words = buf[:bitmap_words(stop - start, excl.n_items)]
    words.fill(0xFFFFFFFF)
    tail = n_bits % 32
    if tail:  # bits past the last query are no pairs: keep them 0 so they are not counted as allowed
        words[-1:] = (1 << tail) - 1
    pos = excl.keys(start, stop)  # strictly increasing: users in order, each user's items sorted and unique
    if pos.shape[0]:
        word = pos >> 5
        bit = xp.left_shift(xp.uint64(1), (pos & 31).astype(xp.uint64))
        # Several exclusions may share a word. Their bits are distinct, so within a run of equal words their sum is
        # their OR: a running sum, read at the end of each run, combines them without atomics or a custom kernel.
        last = xp.ones(word.shape[0], dtype=bool)
        last[:-1] = word[1:] != word[:-1]
        total = xp.cumsum(bit)
        ends = total[last]
        combined = ends.copy()
        combined[1:] -= ends[:-1]
        at = word[last]
        words[at] &= ~combined.astype(xp.uint32)
    return words
