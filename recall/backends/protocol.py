"""The backend protocol: the one seam between the CPU and the GPU.

Everything above it (the engine's query pipeline, metrics, exclusions, padding, ids, the jobs, I/O) is shared and
runs in CI on the CPU; nothing above it asks which device it is on. A backend implements the operations below over
its own array type (``xp`` is ``numpy`` or ``cupy``); ``recall.backends.resolve`` picks one, once, per engine.

Layout conventions shared by both backends:

- vectors are row-major float32 ``(n, dim)`` (float16 for fast mode's approximate pass);
- a score tile is ``(n_tiles, n_users_block, tile_width)``: ``scores[b, u, t]`` is the score of user ``u`` against
  item row ``item_start + b * tile_width + t``;
- a running top-k holds, per user, the k best ``(score, item_row)`` seen so far; item rows are visited in increasing
  order, which lets a strict ``score > k-th best`` test implement the tie rule (equal scores: lower item row first);
- exclusions are CSR over the users of a search (``recall.core.exclusions.Exclusions``): item rows sorted and
  unique within each user;
- results are ``(scores (n, k) float32, item rows (n, k) int64)`` in inner-product space, best first, padded with
  ``(-inf, -1)`` (a pass that re-ranks them may ask for them in no order: ``run_blocks``' ``best_first``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..core.certificate import FastItems, FastUsers
from ..core.exclusions import Exclusions
from ..core.options import EngineOptions
from ..core.tiling import TilePlan

PASS_SHARE = 0.5
"""A float16 pass's time as a share of the float32 search's where a backend knows no better
(``Backend.float16_pass_share``): on the H200 matrix of 2026-12-01, where both run fused kernels, the fast pass took
0.18-0.97 of an exact search, 0.58 at the median (docs/benchmarks.md)."""

#: What ``run_blocks`` returns: a callable that waits for the search and returns its stats (a dict).
Wait = Callable[[], dict]


class Backend(Protocol):
    """The operations an engine needs from a device."""

    name: str
    """"cpu" or "gpu": for summaries, stats and the tune cache's keys (never to branch on above the seam)."""
    xp: Any
    """The array module of this backend's arrays: numpy or cupy."""
    asynchronous: bool
    """Whether ``run_blocks`` returns before the work is done (the device searches while the host goes on), so that
    a caller gains by queueing work ahead (the job runner's searches while the items load)."""
    few_users_area: int
    """Scores per tile that a search of fewer users than the preferred block widens its item tiles to
    (``tiling.plan_tiles``; 0: it keeps them): the CPU's, where every tile costs a call and a pass of its own on the
    host; the GPU keeps its tiles, across which its selection kernels parallelise."""

    # -- where arrays live ----------------------------------------------------------------------------------------
    def module_of(self, arr: Any) -> Any:
        """The array module an input is validated and prepared with: this backend's for its own (device) arrays,
        NumPy for host arrays (a GPU backend stages host users block by block) and for anything a CPU backend is
        given (device arrays are copied to the host)."""

    def ingest(self, arr: Any, own: bool = False) -> Any:
        """``arr`` (any real dtype; host, CuPy or ``__dlpack__``) as a C-contiguous float32 array on this backend,
        without a copy where it already is one, unless ``own``: then never the caller's memory."""

    def largest_norm(self, vecs: Any) -> float:
        """The largest Euclidean norm of the rows of ``vecs`` ((n, dim) float32, this backend's array or a NumPy one),
        in float64; NaN or +inf where some row holds a NaN or an infinity, 0.0 without rows: the users' check before
        a search, in one pass (``metrics.row_norms``' largest, its squares summed maybe in another order)."""

    def row_norms(self, vecs: Any) -> Any:
        """The Euclidean norms of the rows of ``vecs`` ((n, dim), this backend's array or a NumPy one), float64 (n,) of
        the module of ``vecs``: ``metrics.row_norms``, the squares summed maybe in another order (cosine's scaling and
        l2's finished scores take them: ``metrics.prepare_users``' and ``finish_scores``' ``norms_of``)."""

    def finish_l2(self, scores: Any, sq: Any) -> Any:
        """l2's finished scores ``2·s - sq[:, None]`` of (n, k) float32 inner-product ``scores`` and (n,) float32
        squared user norms, float32, of the module of ``scores`` (``metrics.finish_scores``' arithmetic: ``2·s``
        exact, one rounding; -inf stays -inf)."""

    def to_host(self, arr: Any) -> Any:
        """A NumPy copy of a backend array (NumPy arrays are returned as they are)."""

    def empty_out(self, shape: tuple, dtype: Any, host: bool) -> Any:
        """An uninitialised result array: in host memory (page-locked where that speeds copies) when ``host``, else
        on this backend. ``run_blocks`` fills either kind."""

    def store_rows(self, dest: Any, start: int, rows: Any) -> None:
        """Copy host rows (n, dim) into rows ``start:start + n`` of a backend array (from ``empty_out``)."""

    # -- the device and its sizes ---------------------------------------------------------------------------------
    def describe(self) -> str:
        """One line naming the device, for summaries and logs."""

    def identity(self) -> dict[str, str]:
        """What a tuned tiling depends on besides the shape: {"backend", "device", "driver", "runtime"}."""

    def default_budget(self) -> int:
        """Working-memory bytes a search may use when the caller sets no budget."""

    def free_memory(self) -> int:
        """Bytes of memory available now."""

    def state_bytes(self, k: int, n_items: int = 0) -> int:
        """Bytes of running top-k state per user, of a search of ``n_items`` items (0: not known, the most)."""

    def resident_bytes(self, n_items: int, dim: int) -> int:
        """Bytes that ``load_items`` of (n_items, dim) float32 prepared items takes on this backend, with what it
        derives from them (the GPU's transposed copy)."""

    def item_memory(self, budget: int) -> int | None:
        """Bytes resident items may take when the caller sets no ``item_memory``, beside a search's ``budget``: what
        the device can hold; None where the items are in this backend's memory already (the CPU)."""

    def preferred_tiles(self, dim: int, k: int, dtype: Any, n_users: int, n_items: int,
                        options: EngineOptions) -> tuple[int, int, int]:
        """(user block, item tile width, item tiles per GEMM call) this backend runs best with for a pass of
        ``n_users`` users (rows of ``dim`` values of ``dtype``) against ``n_items`` items keeping ``k``, under
        ``options``."""

    def tune_candidates(self, heuristic: tuple[int, int, int]) -> list[tuple[int, int, int]]:
        """The tilings ``recall tune`` tries, the heuristic first."""

    def score_dtype(self, input_dtype: Any) -> Any:
        """The dtype of the score tiles a GEMM of ``input_dtype`` vectors writes (fast mode's float16 inputs:
        float16 scores on the GPU, scaled by ``certificate.output_scale``; float32 on the CPU)."""

    def pass_score_dtype(self, plan: TilePlan, n_users: int, n_items: int, k: int, width: int, dtype: Any,
                         options: EngineOptions) -> Any:
        """The dtype of the scores a pass (``run_blocks`` under ``plan``) of ``n_users`` vectors of ``width``
        columns of ``dtype`` compares and keeps: float32 where a fused kernel compares the sums in its registers,
        else ``score_dtype(dtype)``. What its stats' ``score_dtype`` will say, known before the users are made."""

    # -- the work -------------------------------------------------------------------------------------------------
    def load_items(self, prepared: Any, norms_rank: bool = False,
                   constant_column: tuple[int, float] | None = None,
                   bias_columns: tuple[int, int] | None = None, ranks: Any = None) -> Any:
        """The resident form of prepared items ((n_items, dim) float32, or float16 for fast mode, on this
        backend): what ``run_blocks`` and ``rescore`` take as ``items``. Keeps whatever the backend derives from
        the items (the GPU's transposed copy for its fused kernel) for as long as the engine holds it.
        ``norms_rank``: an item's norm bounds its score (``metrics.norms_rank``), so that a backend that seeds its
        thresholds from a sample of the items may prefer those of the largest norms. ``constant_column`` (column,
        value): every item holds ``value`` in that column (fast mode's shift column,
        ``certificate.FastItems.constant_column``), so that a backend that lowers sampled scores by a bound of the
        sum of |products| (``certificate.seed_margin``) may take that column's product on its own rather than through
        the rows' whole norms. ``bias_columns`` (first, end): columns where every user holds one value and each item
        its own (fast mode's l2 bias parts, ``certificate.FastItems.bias_columns``), whose products such a bound may
        take on their own too. ``ranks``: (n_items,) values of this backend's module (``metrics.centroid_ranks``)
        that such a backend may prefer the largest of, as it would the norms (fast mode's l2 items)."""

    def run_blocks(self, plan: TilePlan, users: Any, items: Any, n_items: int, k: int, excl: Exclusions,
                   out_vals: Any, out_rows: Any, options: EngineOptions, floor: Any = None,
                   left_out: Any = None, best_first: bool = True, need: int = 0) -> Wait:
        """Search every user block of ``plan`` and write each user's top-k (inner-product space, k <= n_items) into
        its row of ``out_vals`` / ``out_rows`` (arrays from ``empty_out``, on the host or the backend). ``users``:
        (n, dim) host or backend array. ``floor``: optional backend float32 (n,) scores; a user then gets only items
        scoring above it (an optimisation: a backend may return more). ``left_out``: optional backend float32 (n,),
        filled with a bound per user: every item a user is not given scores (in the pass's own arithmetic) at most
        the larger of it and the user's k-th result (-inf where it holds fewer than k). Given it, a backend may start
        a user below its k-th best (``EngineOptions.seed_estimate``): at an estimate of its ``need``-th best (1 to k;
        0: k), or at a lower bound of it where ``need`` is under k, and return fewer than k items: for a caller that
        checks every user against its start (fast mode's certificate, which needs k + ``fast.NEED_SLACK`` of a pass
        that keeps more). ``best_first`` False: each user's results may be written in any order (its k best all the
        same, the empty slots anywhere), for a caller that re-ranks them (fast mode's pass: a final sort of k = 1,251
        keys a user is most of its last merge). Returns a callable that waits for this search (the arrays are filled
        by then) and returns its stats; asynchronous backends return once the work is queued.
        """

    def queue_after(self, wait: Wait) -> None:
        """Order the backend's work queued from now on after the search that ``wait`` (``run_blocks``') waits for,
        without waiting for it on the host: fast mode queues a pass's re-scoring behind it this way, and the host
        prepares the launches while the pass runs. ``wait()`` still returns the search's stats afterwards."""

    def rescore(self, users: Any, items: Any, indptr: Any, rows: Any, k: int, budget: int,
                options: EngineOptions, ordered: bool = False) -> tuple[Any, Any, str]:
        """Each user's best ``k`` among its own candidate item rows (CSR: ``rows[indptr[u]:indptr[u+1]]``, host
        int64 ``indptr``, or an int w: every user's list is w rows long, ``rows[u * w:(u + 1) * w]``; ``rows`` host or
        backend int64, duplicates allowed and counted once): (scores, rows)
        (n, k) backend arrays, inner-product space, ready when this returns, and the path taken ("fused" or
        "gemm"). ``budget`` bounds the working memory. ``ordered``: every score is the float32 sum of the products
        in order of dimension, one FMA each from 0 (``fma(u_0, v_0, 0)``, then ``fma(u_d, v_d, s)``): the sums
        of the GPU's fused exact kernel, bit for bit."""

    def certify_exact(self, plan: TilePlan, n_users: int, n_items: int, k: int, width: int,
                      options: EngineOptions) -> bool:
        """Whether an exact search (``plan``, prepared vectors ``width`` columns wide) takes the certified route
        (``options.certified_exact``, ``recall.engine.fast``): where ``rescore(..., ordered=True)`` repeats the sums
        that search would compute, bit for bit, or where that search's own order of summation is no fixed one (a
        library GEMM's, chosen per shape: the ordered sums are then as exact), and, under "auto", where a float16
        pass is faster."""

    def staging_bound(self, n_users: int, n_items: int, width: int, pairs: int, itemsize: int) -> str | None:
        """Why a search of ``n_users`` x ``n_items`` (prepared vectors ``width`` columns wide) excluding ``pairs``
        (user, item) pairs, item rows of ``itemsize`` bytes as given, is bound by the host's staging of those pairs
        rather than by the float32 search's work on the device, or None: there a float16 pass saves nothing (its
        work hides under the same staging), and fast mode and exact precision's certified route under "auto"
        decline to the float32 search (``recall.engine.fast``)."""

    def float16_faster(self) -> bool:
        """Whether this backend's float16 arithmetic (fast mode's passes) is faster than its float32 search: tensor
        cores. Where not (the CPU, which emulates it), fast precision searches in exact precision unless
        ``options.fast_emulation`` asks for the emulation (``recall.engine.engine``)."""

    def float16_pass_share(self, n_users: int, n_items: int, k: int, width: int, options: EngineOptions) -> float:
        """The modelled time of a float16 pass of a search (fast mode's, on float16 copies of users whose prepared
        float32 vectors are ``width`` columns wide) as a share of that float32 search's:
        what fast mode's probe weighs its widened users by (``recall.engine.fast``). :data:`PASS_SHARE` where the
        backend knows no better."""

    def starts_at_need(self, options: EngineOptions) -> bool:
        """Whether fast mode's first float16 pass, seeded, starts each user where its threshold sample says only the
        pass's ``need`` items lie above it (``run_blocks``' ``need``), rather than at a bound of its k + m + 1-th:
        there the margin m decides only how many candidates are kept, merged and re-scored, and fast mode keeps
        fewer below k = 64 (``recall.engine.fast.NEED_MARGIN``)."""

    def fast_users(self, users: Any, items: FastItems, half_scores: bool = False, shift: Any = None) -> FastUsers:
        """``certificate.prepare_users`` of prepared ``users`` (n, D) float32 on this backend (``shift`` too): fast
        mode's float16 copies, with what their certificates need, as backend arrays (the same arithmetic, in as few
        passes as the backend can)."""

    def select(self, scores: Any, rows: Any, k: int) -> tuple[Any, Any]:
        """The best k (score desc, lower row first) of each row of a padded candidate block: scores (n, width)
        float32, rows (n, width) int64, -1 for an empty slot, no row twice in a row. Backend arrays."""

    def merge(self, parts: list[tuple[Any, Any, int]], k: int) -> tuple[Any, Any]:
        """The best ``k`` per user over ``parts``, each (scores (n, w) float32, item rows (n, w) int64 with -1 for
        padding, row offset added to its rows), queued after the backend's earlier work (searches whose results
        these are), on the backend: its outputs are ready for the backend's later work at once, and for the caller
        after ``to_host`` or ``synchronize``. Parts must hold no row twice for a user."""

    def synchronize(self) -> None:
        """Wait for all work queued on this backend."""
