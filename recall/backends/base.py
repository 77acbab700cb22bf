"""The backend protocol: the one seam between the CPU and the GPU.

Everything above it (tiling, metrics, exclusions, padding, ids, I/O) is shared and runs in CI on the CPU. A backend
implements these primitives over its own array type (``xp`` is ``numpy`` or ``cupy``).

Layout conventions shared by both backends:

- vectors are row-major float32 ``(n, dim)``;
- a score tile is ``(n_tiles, n_users_block, tile_width)`` float32: ``scores[b, u, t]`` is the score of user ``u``
  against item row ``item_start + b * tile_width + t``;
- a running top-k state holds, per user, the k best ``(score, item_row)`` seen so far; item rows are visited in
  increasing order, which lets a strict ``score > k-th best`` test implement the tie rule (equal scores: lower item
  row first);
- exclusions are CSR over the users of a block: ``excl_indptr`` (n_users_block + 1,) int64 and ``excl_items`` int64
  item rows, sorted and unique within each user.
"""
from __future__ import annotations

from typing import Any, Protocol


class TopKState(Protocol):
    """Opaque per-backend running top-k for a block of users."""

    n_users: int
    k: int


class Backend(Protocol):
    name: str  # "cpu" or "gpu"
    xp: Any  # the array module: numpy or cupy
    workers: int  # user blocks searched at once, each with its own workspace

    def compute_context(self) -> Any:
        """A context manager held while a search runs (e.g. pinning BLAS to one thread per worker)."""

    def describe(self) -> str:
        """One line naming the device, for summaries and logs."""

    def score_dtype(self, input_dtype: Any) -> Any:
        """The dtype of the score tiles a GEMM of ``input_dtype`` vectors writes (fast mode: float16 on the GPU,
        scaled by ``fast.output_scale``)."""

    def asarray(self, arr: Any) -> Any:
        """``arr`` as a C-contiguous float32 or int64 array on this backend, without a copy where it already is."""

    def asarray_raw(self, arr: Any) -> Any:
        """``arr`` on this backend, keeping its dtype."""

    def empty_out(self, shape: tuple, dtype: Any, host: bool) -> Any:
        """An uninitialised result array: in host memory (page-locked where that helps copies) when ``host``,
        else on this backend. ``run_blocks`` fills either kind."""

    def to_host(self, arr: Any) -> Any:
        """A NumPy copy of a backend array."""

    def free_memory(self) -> int:
        """Bytes of working memory available now."""

    def default_budget(self) -> int:
        """Working-memory bytes a search may use when the caller sets no budget."""

    def state_bytes(self, k: int) -> int:
        """Bytes of running top-k state per user."""

    def preferred_tiles(self, dim: int, k: int) -> tuple[int, int, int]:
        """(user block, item tile width, item tiles per GEMM call) this backend runs best with."""

    def run_blocks(self, plan: Any, users: Any, items: Any, n_items: int, k: int, excl: Any, out_vals: Any,
                   out_rows: Any) -> None:
        """Search every block of ``plan`` and write each user's top-k (inner-product space) into its row of
        ``out_vals`` / ``out_rows`` ((n_users, k) arrays from ``empty_out``, on the host or the backend). ``users`` may be host or backend arrays.
        Each block's work is ``scoring.search_block``; backends differ only in how blocks are staged and overlapped."""

    def gemm_strided_batched(self, users: Any, items: Any, out: Any) -> None:
        """``out[b] = users[b or 0] @ items[b].T`` for every batch ``b``, in one strided-batched GEMM.

        users : (1 or n_tiles, n_users_block, dim) float32, or float16 for fast mode (then items are float16 too and
        the products accumulate in float32); items : (n_tiles, tile_width, dim); out : (n_tiles, n_users_block,
        tile_width) float32. All on this backend.
        """

    def topk_new(self, n_users: int, k: int) -> TopKState:
        """A reusable running top-k for up to ``n_users`` users."""

    def topk_reset(self, state: TopKState, n_users: int) -> None:
        """Empty the state for a new block of ``n_users`` users."""

    def topk_update(self, state: TopKState, scores: Any, item_start: int, n_items: int,
                    excl_indptr: Any, excl_items: Any) -> None:
        """Merge a score tile into the running top-k, skipping excluded items and item rows ``>= n_items``."""

    def topk_result(self, state: TopKState) -> tuple[Any, Any]:
        """(scores (n_users, k) float32, item rows (n_users, k) int64), best first, padded with (-inf, -1)."""

    def synchronize(self) -> None:
        """Wait for all queued work."""

    def rescore_select(self, scores: Any, rows: Any, k: int) -> tuple[Any, Any]:
        """Per row of a padded candidate block, the best k (score desc, lower row first), padded with (-inf, -1).

        scores : (n, width) float32; rows : (n, width) int64 item rows, -1 for an empty slot. On this backend.
        Optional, faster path (``rescore_fused``, the GPU only): see recall/rescore.py.
        """
