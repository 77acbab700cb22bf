"""Fast precision: score float16 copies on tensor cores, re-rank the best candidates in float32, prove the answer.

For every user the engine keeps the ``k + m + 1`` best *approximate* scores (m = ``certificate.margin(k)``, or fewer
below k = 64 where the pass starts at the need: :data:`NEED_MARGIN`), in no order (``Backend.run_blocks``'
``best_first``), re-scores them in float32 (``Backend.rescore``) and takes their exact
top k. The answer is certified when the exact k-th score beats an upper bound of every score left out, from the
least kept approximate score (``recall.core.certificate``).
A user whose certificate fails is tried once more with ``k + 4m`` candidates (where score tiles are float16, its
scores shifted by its exact k-th score: the *widened* pass, over those users only); where that fails too, once more
with four times as many (:data:`WIDENED_PASSES`), as long as the candidates stay within
:data:`MAX_CANDIDATE_SHARE_TILES16` of the catalogue; and it is searched again in exact mode at the end, so the
result is always the exact answer. ``engine.stats["widened_users"]`` counts the second tries,
``["widened_passes"]`` each further pass, ``["fallback_users"]`` the exact searches. Where a widened pass certified
most of a search's users (:data:`WIDE_FIRST`: data whose best scores lie closer together than the bound, as
normalised vectors of many dimensions against a large catalogue), the engine's next searches of that k keep that
pass's candidates in their first pass (``FastState.margins``, ``stats["first_margin"]``), so that most users need one
float16 pass, not two or three.

Fast mode declines at once where it re-scores too large a share of the catalogue (:data:`MAX_CANDIDATE_SHARE`, lower
above :data:`LARGE_K` (``_share_limit``) and where the float16 pass keeps float16 score tiles): it then costs more
than exact mode's whole search, whatever the certificate does; where the search is small (:func:`min_scores`); and
where the host's staging of the search's excluded pairs outlasts the float32 search's work on the device
(``Backend.staging_bound``: the float32 search hides under that staging, and the float16 pass would only add its
re-scoring and certificates after it). A large search first runs on a sample of its users
(``EngineOptions.fast_sample``): where the certificate does not pay on them (:data:`DECLINE_COST`, e.g. data full of
exact ties), every user is searched in exact mode and ``stats["precision"]`` says "exact", with the reason in
``stats["fast_declined"]``; else every user, the sampled ones too, is searched in fast mode. The next search of the
same k skips the sample where this one paid (``FastState.trusted``); a search too small to sample declines where the
engine's last one of its k did not pay, and runs fast mode again after :data:`RECHECK_EVERY` such searches, twice as
many after each that did not pay (``FastState.unpaid``).

Exact precision takes the same search where the backend says it pays (``certifies_exact``: the *certified route*):
the candidates are then re-scored with the exact search's own float32 sums (``Backend.rescore``'s ``ordered``: every
dimension in order, one FMA each, the fused kernel's sequence) and the users whose certificate fails are searched
by the fused kernel itself, so that every score, and therefore every list, is exact mode's bit for bit. The bound
below covers any float32 sum of the products, whatever its order, so the proof is the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..core import certificate, metrics
from ..core.errors import ResourceError
from ..core.exclusions import Exclusions

#: Fast mode declines where a sample's modelled cost is above this share of an exact search: per user of the sample,
#: ``share * (1 + widened) + fallbacks``, ``share`` the float16 pass's time as a share of the float32 search's
#: (``Backend.float16_pass_share``). The first pass costs ``share``, a widened user another float16 pass over it (no
#: float32 search), a user that falls back one exact search. Why 0.75: on the H200 matrix (docs/benchmarks.md,
#: 2026-12-01, the 12 cells without fallbacks and k <= 2,048, both searches fused) the fast pass costs 0.18-0.97 of an
#: exact search, 0.58 at the median. With the share at 0.5 there, this declines where fallbacks plus half the widened
#: users pass a quarter of the sample, which keeps fast mode from losing wherever its pass costs at most 0.75 (9 of
#: those 12 cells); where they pass it, the most fast mode could still have gained is small (under 25% where the pass
#: costs >= 0.5). Where both searches are GEMMs (rows wider than the fused float32 kernel takes: the float16 pass took
#: 0.11-0.15 of the float32 search) the share is 0.25: a sample whose every user was widened (20k x 1M x 768, cosine,
#: H200 2026-12-04) runs, at a modelled half of an exact search.
DECLINE_COST = 0.75
#: Candidates re-scored per user (k + m + 1) above this share of the items make fast mode slower than exact mode, even
#: with every certificate holding: the re-scoring gathers each candidate's row, and the float16 pass keeps k + m + 1
#: where the float32 search keeps k. Exact mode's certified route against its float32 search, H200, 2026-12-05
#: 03:1x UTC (docs/benchmarks.md), k = 2,048 (2,561 candidates): 2.6% of the items -> 0.67-0.76x the float32
#: search's time (200k x 100k, l2, 32 and 64 dims); 3.9% (65,536 items) -> 0.55x cosine, 0.57x l2, 0.87x ip (64
#: dims) and 1.03x ip at 128 dims, whose float32 search is the GEMM's most efficient. 3% keeps the route where it was
#: measured to pay at 2.6% and short of where rows of 128 break even. That is where
#: the pass compares float32 sums (a fused kernel); where it keeps float16 score tiles (cuBLAS + filter: passes
#: above fused.FUSED_HALF_SEEDED_MAX_K, rows wider than the float16 kernel multiplies) the limit is
#: MAX_CANDIDATE_SHARE_TILES16: at 1.02% (10k x 1M x 64, k = 8,192) fast mode took 1.21x exact mode's time (0.108
#: against 0.0894 s, H200 2026-12-02 21:4x UTC); above LARGE_K it is lower (``_share_limit``). A rough model
#: (dims and shapes differ), so it acts only on catalogues of at least SHARE_MIN_ITEMS, the size those cells are, and
#: on smaller ones searched by as many scores as the size rule routes (``measured_min_scores``; MAX_CANDIDATE_SHARE
#: there, not the float16 tiles' limit; MIN_SCORES until 2026-12-06, when the rule took smaller searches):
#: 200k x 20k x 64 ip at k = 1,000 (6.25% of the items) took the route 0.150 s against 0.062 s for the float32 search
#: (H100, 2026-12-05, docs/benchmarks.md); 400k x 10k at k = 100 (1.26%) 0.020 s against 0.029 s.
MAX_CANDIDATE_SHARE = 0.03
#: k above which the re-scoring's selection keeps 4,096 keys a user or more (a power of two at least k: the GPU's
#: rescore.launch_config), and the share the route pays at is lower: MAX_CANDIDATE_SHARE_LARGE_K where the k + m + 1
#: candidates fit in one chunk of those keys (ONE_CHUNK_WIDE: 85 KB of shared memory at k = 3,000, two blocks an SM
#: on the H200), MAX_CANDIDATE_SHARE_TWO_CHUNKS where they do not (118 KB, one block an SM). The route against its
#: float32 search, H200, 2026-12-05 (docs/benchmarks.md): in one chunk (03:52 UTC), 0.94-0.98% -> 0.67-0.74x
#: (100k x 400k x 64 ip, k = 3,000; 50k x 320k x 128, k = 2,500), 1.9-1.95% -> 0.90-0.93x (200k and 160k items),
#: 3.75% -> 1.02x; in two chunks (as every k above 2,048 took before, 03:1x UTC), 0.5% -> 0.71x (20k x 1M x 64, l2,
#: k = 4,000) and 0.85x (10k x 1M, ip, k = 4,096), 0.94-0.98% -> 1.02-1.09x, 1.9% -> 1.37-1.55x, which the 2%
#: limit then in place had let through. Since 2026-12-05 (rescore.SZ_STEP) lists of up to 2 K_pad keys take one chunk
#: of their length rounded up to 32 keys, no more shared memory than those two chunks took: the limits, measured
#: before, can only err towards declining.
LARGE_K = 2048
MAX_CANDIDATE_SHARE_LARGE_K = 0.02
ONE_CHUNK_WIDE = 4096
MAX_CANDIDATE_SHARE_TWO_CHUNKS = 0.006
#: The same limit where the float16 pass keeps float16 score tiles (``Backend.pass_score_dtype``): 0.26% of the items
#: gave 0.86x exact mode's time there (20k x 1M x 64, k = 2,048, 2026-12-01), 1.02% 1.21x.
MAX_CANDIDATE_SHARE_TILES16 = 0.005
SHARE_MIN_ITEMS = 65_536
#: Searches of fewer user x item scores than this (on catalogues of at least SHARE_MIN_ITEMS) take exact mode: the
#: certificate's passes (the approximate search, the re-scoring, the checks) cost about as much as a small exact
#: search. An embedded engine against 1M x 64 items at k = 100 (H200, docs/benchmarks.md, 2026-12-01): 256 users
#: 4.10 ms fast against 2.19 ms exact, 1,024 users 4.97 against 4.94 ms.
MIN_SCORES = 1 << 30
#: The same on catalogues of fewer than SHARE_MIN_ITEMS items, for fast mode and exact precision's route alike. The
#: route's own steps (its threshold sample, the users' float16 copies, the re-scoring, the certificate's checks and
#: their round trips to the host) take 1.4-2.2 ms whatever the search's size, where the float32 search of a small
#: catalogue takes 0.6 ms up. The route against the float32 search (H100, 2026-12-06, docs/benchmarks.md; d = 64,
#: k = 10 and 100, skewed norms): 8M-33M scores 0.27-0.58x its time, 100M-131M 0.64-0.83x, 400M-524M 0.98-1.39x
#: (exact ties 0.98x), 1.0G-1.6G 1.7-2.5x. Before, exact precision took the route from MIN_SCORES on (it missed
#: 1.8x on 50k x 20k) and fast mode at any size (2.1x exact mode's time on 2,000 users x 4,096 items).
SMALL_CATALOGUE_MIN_SCORES = 1 << 29
#: Both limits were measured at 64 dimensions. Rows wider than that lower them: the float32 search's cost grows with
#: the dimension while most of the route's own steps do not. The route against the float32 search (H100, 2026-12-06,
#: docs/benchmarks.md; skewed norms, k = 10 and 100) breaks even at about 800M scores at d = 32, 450M at 64, 250M at
#: 128 and 140M at 256 on catalogues of fewer than SHARE_MIN_ITEMS items (the limit scaled by 64 / d), and at about
#: 1G at 64 dimensions, 200-400M at 128 and 150-200M at 256 on 100k and 1M items (scaled by (64 / d)^1.5). Rows of
#: fewer than 64 dimensions keep the limits (d = 32 broke even near them: 0.96-1.20x from 524M to 1G), rows of more
#: than ROUTE_DIM_MAX take that width's (unmeasured beyond it; the float32 search there is cuBLAS's GEMM, slower still).
ROUTE_DIM_BASE = 64
ROUTE_DIM_MAX = 256
#: A first float16 pass may start each user where its threshold sample says only k + NEED_SLACK items score above it
#: (``Backend.run_blocks``' ``need``), not the k + m + 1 it keeps: its certificate holds against the start wherever the
#: user's exact k-th best lies above the start's bound (``certificate.certified``), with the slack's items between.
#: Not at a margin learned wider than the first (``_search_fast``): there the scores crowd closer than the bound. On
#: 2M users x 4,096 skewed items under l2 (H100, 2026-12-06, docs/benchmarks.md) a slack of 1 left 503 users to a
#: widened pass, 2 left 9, 3 none: a widened pass costs its search about 2 ms, one more rank 1-2% (1M x 4,096 ip).
NEED_SLACK = 3
#: Where the backend's first pass starts at the need (``Backend.starts_at_need``), its margin decides only how many
#: candidates each user keeps, merges and re-scores: below k = NEED_MARGIN_MAX_K the first pass keeps k + m + 1 within
#: the power of two that holds k + NEED_MARGIN + 1 (:func:`_default_margin`; k = 50: 64 candidates, not 67; k = 20: 32,
#: not 37), never more than ``certificate.margin(k)``. 64 keys a user are what the GPU's merges sort a warp a user
#: (``fused.MERGE_WARP_K``). On the H100 (2026-12-07 02:00 UTC, docs/benchmarks.md, interleaved): 200k x 20k x 64 ip
#: at k = 50 8.0 ms against 9.3 (2.13x the float32 search), 1M x 100k 128 against 135, 500k x 8,192 x 128 at k = 20
#: 12.1 against 13.5, 1M x 20k x 64 l2 at k = 20 31.7 against 33.6; clustered 500k x 50k cosine at k = 50 and
#: k = 5 even. Margins of 4 and 6 widened users at k = 20.
NEED_MARGIN = 8
NEED_MARGIN_MAX_K = 64
#: Under l2 the float16 passes of catalogues of at most this many items take half their threshold sample from the
#: items nearest the items' centroid (``metrics.centroid_ranks``), the rest evenly spaced, and start at the sample's
#: need-th best (``selection.start_rank``); larger catalogues sample evenly and start at an estimate. Counted on the
#: CPU (``scripts/lab/need_counts.py``, k = 10, docs/benchmarks.md): 4,096 and 8,192 items pass 0.3-0.7x the scores
#: a user; 16,000 skewed items 0.9x on average but 1.8x at the 99th percentile; 100k items 1.7x, 1M 5x (the users
#: far from the centre find none of their best items near it). On the H100, one process, 2M x 4,096 x 32 took
#: 23.1 ms so (``NEED_SLACK`` 3) against 24.7 ms sampled evenly (slack 2; docs/benchmarks.md).
CENTROID_MAX_ITEMS = 8192
#: ip and cosine catalogues whose mean lies more than this many times their spread from the origin are rounded to
#: float16 about it, and their users split along its direction (``certificate``, "Items far from the origin", "Users
#: along the centre"): any centre keeps the bound, a near one keeps it tight. On the CPU's emulation (3,000 users x
#: 30,000 ``clustered:offset=X`` items, docs/benchmarks.md) certificates about the origin start to widen users near
#: 2.5 spreads (cosine d = 128 k = 20: 5 at 2.5, 138 at 3.2, 2,431 at 4.8) and none widened below 1.8, nor on
#: half-normal (non-negative) rows at 1.3, which stay uncentred here: the GPU's cost of the centre (fast16.cu's extra
#: sums) is not yet measured where it would buy nothing. l2's own rule, FAR = 8, left those about the origin. Data
#: about the origin (every bench kind without ``offset``: ratios under 0.1) is rounded as before.
FAST_FAR = 2.0
#: Sample 1/SAMPLE_DIVISOR of the users (at most ``EngineOptions.fast_sample``), and only when that is at least
#: SAMPLE_MIN users: a smaller sample's fraction is too noisy to act on (+-4% at 128 users around 0.25), and a
#: search that small gains or loses little either way.
SAMPLE_DIVISOR = 50
SAMPLE_MIN = 128
#: A search too small to sample (under SAMPLE_MIN x SAMPLE_DIVISOR users) searches in exact mode where the engine's
#: last fast search of the same k did not pay (its modelled cost above DECLINE_COST: a sample's probe that declined,
#: or a whole search whose users fell back), so that an embedded pipeline's small calls on data the certificate
#: cannot order (exact ties) pay for the fallbacks once, not at every call (``FastState.unpaid``,
#: ``stats["fast_declined"]``). The RECHECK_EVERY-th such search runs fast mode again and finds out afresh; where that
#: one does not pay either, the next recheck comes after twice as many, up to RECHECK_MOST. A recheck on data still
#: tie-heavy costs what a fallen-back search does (modelled as DECLINE_COST models it: the float16 passes and an exact
#: search for most users, 1.5-2 exact searches), spread over the searches declined before it: 3-6% at first, under 1%
#: from the fourth recheck on, while data that turns continuous again is found within RECHECK_MOST searches.
RECHECK_EVERY = 16
RECHECK_MOST = 256
#: Searches of at most this many users make every user's float16 copy before the sample's probe (which takes its rows
#: of them); larger ones let the probe make its own (see ``search``).
PREPARE_ALL_FIRST = 65_536
#: The widened pass keeps WIDEN times the margin of the first (and each further one WIDEN times the last's).
WIDEN = 4
#: Widened passes a user may take before exact mode: the second keeps WIDEN times the first's margin, within
#: MAX_CANDIDATE_SHARE_TILES16 of a catalogue of SHARE_MIN_ITEMS or more. The case (H200, 2026-12-04 17:0x UTC,
#: docs/benchmarks.md): 20k x 1M x 1,536, cosine, k = 100, where 397 of the sample's 400 users failed at k + 4m = 201
#: candidates and fast mode declined (1.31 s, the float32 search); the CPU's emulation of 100 of those users against
#: 500k items certifies 96% at 201 and all at 301. With the second pass (17:19 UTC) the probe learns k + 16m and the
#: search takes 0.149 s, no user widened or falling back. A user whose best scores tie at its k-th place (whose
#: certificate no number of candidates short of its whole tie can prove) pays one more float16 pass before exact
#: mode; the sample's model counts it (``_cost``).
WIDENED_PASSES = 2
#: Where a widened pass certified more than this share of a search's users (the first such pass, where the first pass
#: certified at most that share), the next searches of that k start with its margin (``FastState.margins``): most of
#: their users would otherwise pay for two float16 passes and two re-scorings, or more. Only where those candidates
#: stay within MAX_CANDIDATE_SHARE_TILES16 of the catalogue (or the catalogue is under SHARE_MIN_ITEMS), so that the
#: wider first pass never re-scores a share the rough models above would decline. The case (H200, 2026-12-04 05:11 UTC,
#: docs/benchmarks.md): 20k x 1M x 768, cosine, k = 100, where 19,999 of 20,000 users were widened and none fell
#: back; the CPU's emulation of the same arithmetic on 200 of its users certifies none at k + m + 1 = 126
#: candidates and 97.5-100% at k + 4m + 1 = 201 (``scripts/lab/margin_needed.py``). The sample's probe itself
#: always runs at the first margin, so that a new probe finds out afresh.
WIDE_FIRST = 0.5
#: A search of at least this many users whose sample's every user would have been certified by a first pass of
#: fewer candidates, within a smaller power of two (:func:`_narrow_margin`: k = 1,000 keeps 1,024, not 1,251), keeps
#: that many in its first pass (``FastState.margins``, ``stats["first_margin"]``): each user's merges sort half the
#: keys and its re-scoring gathers a fifth fewer rows. The sample's own pass tells, without another pass: a user is
#: certified by the narrower pass exactly where its exact k-th score beats the bound of the narrower pass's least
#: kept score (``_certified_pass``'s ``narrow``). Exact mode's route on the H200 (2026-12-04, docs/benchmarks.md),
#: the narrowed margin of 23 against 250: 200k x 100k x 64 ip, k = 1,000 0.0865 s against 0.0948 s, 200k x 100k x
#: 32 l2 0.0931 against 0.1012, 100k x 1M x 64 0.1265 against 0.1338, no user widened. Smaller searches keep the
#: margin: a widened pass costs milliseconds whatever its users (20k x 1M x 64 cosine at k = 1,000: 13 users
#: widened, 0.0332 s against 0.0297 s), more than the narrower pass saves them.
NARROW_MIN_USERS = 65_536
#: The narrower margin a probe tries where no smaller power of two holds k + 17 candidates and k/4 is at least twice
#: as wide (k from 512 on, k = 2,048 for instance): a margin of 64, a fifth fewer rows re-scored at k = 2,048. The
#: certificate's margin follows the density of the scores at the k-th place, not k. Exact mode's route on the H200
#: (docs/benchmarks.md), with a margin of 64 against 512 at k = 2,048: 50k x 1M x 64 0.0878 s against 0.0949 s
#: (2026-12-04); 100k x 130k x 64 cosine 0.0663 against 0.0719, 200k x 100k x 32 l2 0.1316 against 0.1464
#: (2026-12-05, this rule), no user widened.
NARROW_FLAT = 64
#: A search at a narrowed first margin that widened more than this share of its users hands the next searches of
#: that k the default margin back (their sample's probe then finds out afresh).
NARROW_MISS = 0.001
#: Where score tiles are float16, each user's scores are shifted by its best float32 score over at most this many
#: evenly spaced items (certificate.prepare_users' ``shift``): the scores the certificate compares then lie near 0,
#: where float16 tiles round them least (on clustered data at d = 256, 3% of first certificates fail instead of 80%).
#: The cost: a float32 GEMM of the users against 1,024 items, about 0.1% of a search of a million items. A pass that
#: keeps w candidates samples n_items // w items where that is fewer (:func:`shift_rows`), so that their best lies
#: near the w-th score, the one its certificate compares, rather than far above it: on the CPU's emulation of
#: float16 tiles (2,000 x 20,000, popular ip, d = 128 and 256, k = 1,000 and 2,048; docs/benchmarks.md) 4-23 users
#: of 2,000 widened with the best of 1,024, none with this.
SHIFT_ITEMS = 1024
#: Users per block of that GEMM: (16,384 x 1,024) float32 scores are 64 MiB.
_SHIFT_BLOCK = 16_384


@dataclass
class FastState:
    """What a fast engine prepares once: the float16 items (resident) and the maxima the bound needs; and the k of
    the searches whose certificates paid last time (``trusted``: the next search of that k needs no probe), of those
    whose did not (``unpaid``: the next search of that k too small to sample declines, RECHECK_EVERY), and the
    first-pass margins learned for a k (``margins``: see WIDE_FIRST)."""

    items: certificate.FastItems
    resident: Any  # the backend's resident form of items.vecs16
    trusted: set = field(default_factory=set)
    margins: dict = field(default_factory=dict)  # k -> the first pass's margin, where not _default_margin's
    # (learned wider, WIDE_FIRST, or narrower, NARROW_MIN_USERS)
    unpaid: dict = field(default_factory=dict)  # k -> (small searches declined since its last fast search, which did
    # not pay; the searches until the next recheck: RECHECK_EVERY)
    plans: dict = field(default_factory=dict)  # (users, candidates) -> the plan of the current search's float16
    # passes of that shape (``_pass_plan``; cleared as each search starts)


def _state(engine: Any) -> FastState:
    if engine._fast is None:
        backend = engine.backend
        bias_col = metrics.bias_column(engine.metric, engine.dim)
        # ip and cosine rows off the origin are rounded about their centre (l2's rows were moved by l2's own rule
        # already), from FAST_FAR spreads out.
        centre = None if bias_col is not None else metrics.far_centre(
            backend.to_host(engine.prepared_items[:metrics.CENTRE_ROWS]), FAST_FAR)
        fast_items = certificate.prepare_items(backend.xp, engine.prepared_items, bias_col, centre)
        # Under l2 a small catalogue's float16 passes sample half their rows nearest the centroid
        # (CENTROID_MAX_ITEMS, metrics.centroid_ranks), from the exact prepared vectors.
        ranks = (metrics.centroid_ranks(backend.xp, engine.prepared_items, engine.metric, engine.dim)
                 if engine.n_items <= CENTROID_MAX_ITEMS else None)
        engine._fast = FastState(fast_items, backend.load_items(fast_items.vecs16, metrics.norms_rank(engine.metric),
                                                                fast_items.constant_column,
                                                                fast_items.bias_columns, ranks))
    return engine._fast


def certifies_exact(engine: Any, users: Any, k: int) -> bool:
    """Whether an exact search of prepared ``users`` takes the certified route (``EngineOptions.certified_exact``):
    items resident, a backend that repeats the search's exact sums (``Backend.certify_exact``) and, under "auto", a
    search of at least ``min_scores`` scores (below, the extra passes cost more than the float16 products save) whose
    users are on the backend or fit in the memory budget there (``search`` moves them: their float16 copies are made
    where the items are; a larger host array is staged block by block by exact mode's own search)."""
    options = engine.options
    n_users, n_items = int(users.shape[0]), engine.n_items
    if options.certified_exact == "off" or engine.streamed or n_users == 0:
        return False
    if options.certified_exact == "auto" and (_too_small(engine, n_users) is not None or (
            isinstance(users, np.ndarray) and users.nbytes > engine.memory_budget)):
        return False
    return engine.backend.certify_exact(engine.plan(users, n_items, k), n_users, n_items, k,
                                        int(users.shape[1]), options)


def min_scores(engine: Any) -> int:
    """The fewest user x item scores a search of this engine runs a float16 pass for (fast mode, and exact
    precision's route under "auto"): ``EngineOptions.float16_min_scores``, else SMALL_CATALOGUE_MIN_SCORES on a
    catalogue of fewer than SHARE_MIN_ITEMS items and MIN_SCORES on a larger one, lowered for rows of more than
    ROUTE_DIM_BASE dimensions."""
    asked = engine.options.float16_min_scores
    return measured_min_scores(engine) if asked is None else asked


def measured_min_scores(engine: Any) -> int:
    """``min_scores``' measured rule, whatever the options ask for."""
    wider = min(max(engine.dim, ROUTE_DIM_BASE), ROUTE_DIM_MAX) / ROUTE_DIM_BASE
    if engine.n_items < SHARE_MIN_ITEMS:
        return int(SMALL_CATALOGUE_MIN_SCORES / wider)
    return int(MIN_SCORES / wider ** 1.5)


def _too_small(engine: Any, n_users: int) -> str | None:
    """Why a search of ``n_users`` is too small for a float16 pass (``min_scores``), or None."""
    least = min_scores(engine)
    if n_users * engine.n_items >= least:
        return None
    return (f"{n_users:,} users x {engine.n_items:,} items is under {least:,} scores: the float16 pass's own "
            f"steps would cost more than its products save")


def search(engine: Any, users: Any, k: int, excl: Exclusions, ordered: bool = False) -> tuple[Any, Any]:
    """Fast mode's search of prepared ``users`` (n, dim) float32 (host or backend): (scores, rows) (n, k) backend
    arrays, inner-product space, exactly exact mode's answer; sets ``engine.stats``. ``ordered``: exact precision's
    certified route (the module docstring): exact mode's scores bit for bit."""
    # Host users of a device backend go to it first: their float16 copies and certificates are made there, not on
    # the host (1M users x 64 against 4,096 items: 1.53 s with NumPy's copies, 0.115 s without, docs/benchmarks.md).
    # The route's users fit the memory budget (``certifies_exact``) unless it was forced on; where fast mode's do
    # not, exact mode stages them block by block, as the route declines to.
    host = engine.backend.module_of(users) is not engine.backend.xp
    if engine._fast is not None:
        engine._fast.plans.clear()  # (the options, budget or tune cache may have changed since the last search)
    declined = None
    if ordered and engine._fast is None and not _room_for_copy(engine):
        declined = "no room on the device for a float16 copy of the items beside the memory budget"
    elif host and not ordered and users.nbytes > engine.memory_budget:
        declined = (f"{int(users.shape[0]):,} host users ({users.nbytes:,} bytes) are more than the memory budget "
                    f"({engine.memory_budget:,} bytes) holds: exact mode stages them block by block, where fast mode "
                    f"would make their float16 copies on the host")
    if declined is None and excl.items.size and not (ordered and engine.options.certified_exact != "auto"):
        declined = engine.backend.staging_bound(int(users.shape[0]), engine.n_items, int(users.shape[1]),
                                                int(excl.items.size), excl.items.itemsize)
    if declined is not None:
        vals, rows = _declined_search(engine, users, k, excl, declined)
    else:
        if ordered or host:
            users = engine.backend.ingest(users)
        try:
            vals, rows = _search(engine, users, k, excl, ordered)
        except ResourceError as exc:
            # Fast mode's passes keep more candidates a user than exact mode's k (k + m + 1, and more where
            # widened): a memory budget can hold exact mode's search and not those.
            vals, rows = _declined_search(engine, users, k, excl, (
                f"the memory budget holds exact mode's search, not fast mode's passes: {exc}"))
    if ordered:
        engine.stats = _as_exact(engine.stats)
    return vals, rows


def _room_for_copy(engine: Any) -> bool:
    """Whether the float16 copy of the items (the certified route's, kept by the engine) fits in the device's free
    memory with the search's memory budget still free beside it."""
    width = int(engine.prepared_items.shape[1]) + 8  # the certificate's columns, rounded up: at most 8 more
    return engine.backend.free_memory() - 2 * engine.n_items * width >= engine.memory_budget


def _as_exact(stats: dict) -> dict:
    """A fast search's stats as the certified route of an exact search reports them: ``precision`` "exact",
    ``route`` "certified" (or "float32" where the route declined: ``certified_declined`` says why)."""
    out = dict(stats)
    certified = out.get("precision") == "fast"
    out.update(precision="exact", route="certified" if certified else "float32")
    declined = out.pop("fast_declined", None)
    if declined is not None:
        out["certified_declined"] = declined
    return out


def _search(engine: Any, users: Any, k: int, excl: Exclusions, ordered: bool) -> tuple[Any, Any]:
    n_users = int(users.shape[0])
    wide = k + _default_margin(engine, k) + 1
    # Too small a search (min_scores); then the share models, which act on catalogues of the measured cells' size,
    # the share limit of a pass comparing float32 sums also on a smaller catalogue searched by as many scores as the
    # measured size rule routes (not the options' limit: tests run fast mode's passes on small data at any share).
    small = engine.n_items < SHARE_MIN_ITEMS
    many = n_users * engine.n_items >= measured_min_scores(engine)
    # (Exact precision's route was sized by ``certifies_exact`` under "auto"; "on" takes it at any size.)
    declined = None if ordered else _too_small(engine, n_users)
    if declined is None and (many or not small):
        # The limit where the pass keeps float16 tiles is asked for only above the lower one (it makes the float16
        # copy of the items).
        limit = _share_limit(k, wide)
        if (not small and MAX_CANDIDATE_SHARE_TILES16 * engine.n_items < wide <= limit * engine.n_items
                and _tiles16(engine, n_users, k)):
            limit = MAX_CANDIDATE_SHARE_TILES16
        if wide > limit * engine.n_items:
            declined = (f"{wide:,} candidates per user would be re-scored, {wide / engine.n_items:.2%} of the "
                        f"{engine.n_items:,} items (above {limit:.1%}): exact mode is faster")
    sample = _sample_rows(n_users, engine.options.fast_sample)
    if declined is None and sample is None:
        declined = _owed(engine, k, n_users)
    if declined is not None:
        return _declined_search(engine, users, k, excl, declined)
    share = _pass_share(engine, n_users, k)
    if sample is None:
        vals, rows, engine.stats = _search_fast(engine, users, k, excl, None, ordered, _first_margin(engine, k))
        _learn_margin(engine, k, engine.stats, n_users)
        _remember_cost(engine, k, engine.stats, n_users, share)
        return vals, rows
    if engine._fast is not None and k in engine._fast.trusted:
        # The engine's last search of this k ran fast mode and its certificates paid: this one skips the probe (a
        # job's batches, a pipeline's calls: the same users' distribution, search after search). Where its own
        # fallbacks do not pay, the next search probes again.
        vals, rows, stats = _search_fast(engine, users, k, excl, None, ordered, _first_margin(engine, k))
        _learn_margin(engine, k, stats, n_users)
        _trust(engine, k, stats, n_users, share)
        engine.stats = {**stats, "fast_sample": 0, "probe": "skipped"}
        return vals, rows
    # The sample is a probe: every user, the sampled ones too, is searched again below, so that neither the users
    # nor their exclusions are cut in two on the host (for S1's 100k users with 200 exclusions each, 0.06 s of
    # NumPy on the development machine; the sample repeats 1/50 of the search). In a search of up to
    # PREPARE_ALL_FIRST users every user's float16 copy is made once, before the probe, which takes its users' rows
    # of it: making the copies cost 1.2-3.0 ms of launches on the H200 for 400 users as for 20,000, up to a tenth of
    # such a search, when they were array operations (one launch since Backend.fast_users: 0.3 ms for 200k users;
    # docs/benchmarks.md). In a larger one the probe makes its own: where fast mode then declines, everyone's copies
    # would be made for nothing (24 ms for 1M users by the array operations, 4% of an exact search).
    prepared = probe_users = None
    if n_users <= PREPARE_ALL_FIRST:
        prepared = _prepare(engine, users, k)
        probe_users = prepared.take(sample if isinstance(prepared.vecs16, np.ndarray)
                                    else engine.backend.xp.asarray(sample))
    narrow = _narrow_margin(k, engine.n_items) if n_users >= NARROW_MIN_USERS else None
    _, _, s_stats = _search_fast(engine, _take(engine.backend.xp, users, sample), k, excl.subset(sample),
                                 probe_users, ordered, narrow=narrow)
    # The decision models the search the probe leads to: where it learns a wider first pass (a widened pass that
    # certified most of its users), the sample's passes after that one; else its own.
    cost = _taught_cost(engine, k, s_stats, sample.size, share)
    if cost > DECLINE_COST:
        engine._fast.trusted.discard(k)
        _owe(engine, k)
        vals, rows, run_stats = _search_exact(engine, users, k, excl)
        stats = {**run_stats, "precision": "exact",
                 "fast_declined": (f"a sample of {sample.size:,} users: {s_stats['fallback_fraction']:.0%} fell "
                                   f"back to exact search, {s_stats['widened_users'] / sample.size:.0%} were "
                                   f"widened; at a modelled {cost:.2f} of an exact search (the float16 pass "
                                   f"{share:.2f} of one, again for each widened pass of a user, a whole one for "
                                   f"each user that fell back), above {DECLINE_COST}, fast mode would not pay"),
                 "fallback_users": s_stats["fallback_users"], "widened_users": s_stats["widened_users"],
                 "fallback_fraction": s_stats["fallback_users"] / n_users}
    else:
        _learn_margin(engine, k, s_stats, sample.size, narrow)
        margin = _first_margin(engine, k)
        if prepared is not None and margin != _default_margin(engine, k) and (
                prepared.half_scores != _tiles16(engine, n_users, k, margin)):
            prepared = None  # made for the probe's pass, whose score tiles were of another dtype than this one's
        vals, rows, stats = _search_fast(engine, users, k, excl, prepared, ordered, margin)
        _learn_margin(engine, k, stats, n_users)
        _trust(engine, k, stats, n_users, share)
    stats.update(fast_sample=int(sample.size), sample_fallback_fraction=s_stats["fallback_fraction"],
                 probe="sampled")
    engine.stats = stats
    return vals, rows


def _cost(stats: dict, n_users: int, share: float, start: int = 0) -> float:
    """The modelled time of a fast search of ``n_users`` with these stats as a share of an exact search's (see
    DECLINE_COST): ``share`` the float16 pass's (``Backend.float16_pass_share``), once for every user and again for
    each user of each widened pass from the ``start``-th (0: every one; a search whose first pass kept the margin of
    its ``start - 1``-th would have needed only the later ones), a whole exact search for each user that fell back."""
    n = max(n_users, 1)
    again = sum(users for _, users, _ in stats["widened_passes"][start:])
    return share * (1 + again / n) + stats["fallback_users"] / n


def _taught_cost(engine: Any, k: int, stats: dict, n_users: int, share: float) -> float:
    """``_cost`` of a search like this one (``stats``) whose first pass keeps the margin it teaches the next searches
    of k (``_learned_pass``): only its widened passes after that one count."""
    learned = _learned_pass(engine, k, stats, n_users)
    return _cost(stats, n_users, share, 0 if learned is None else learned + 1)


def _first_margin(engine: Any, k: int) -> int:
    """The margin of the first float16 pass of a search at ``k``: the one learned for k (WIDE_FIRST,
    NARROW_MIN_USERS), else :func:`_default_margin`."""
    learned = None if engine._fast is None else engine._fast.margins.get(k)
    return _default_margin(engine, k) if learned is None else learned


def _default_margin(engine: Any, k: int) -> int:
    """The first pass's margin at ``k`` where none is learned: ``certificate.margin(k)``, or, below NEED_MARGIN_MAX_K
    where the backend starts its passes at the need, the most that keeps k + m + 1 within the power of two holding
    k + NEED_MARGIN + 1 (k = 50: 13, 64 candidates; k = 20: 11; k = 10: the certificate's 16), if less."""
    default = certificate.margin(k)
    if k >= NEED_MARGIN_MAX_K or not engine.backend.starts_at_need(engine.options):
        return default
    return min(default, (1 << (k + NEED_MARGIN).bit_length()) - k - 1)


def _narrow_margin(k: int, n_items: int) -> int | None:
    """The narrower first margin a sample's probe tries for ``k`` (NARROW_MIN_USERS): the most that keeps k + m + 1
    candidates within the power of two that holds k + 17 (the least margin, 16), where that power is smaller than
    the one the default margin's candidates need; else NARROW_FLAT where the default is at least twice that (k from
    512 on; k = 2,048: 2,113 candidates, not 2,561); else None (k = 100: 126 candidates, 25 of margin already). None
    too where the narrower pass would keep the whole catalogue."""
    default = certificate.margin(k)
    least = 1 << (k + 16).bit_length()
    if least < 1 << (k + default).bit_length():
        narrow = least - k - 1
    elif default >= 2 * NARROW_FLAT:
        narrow = NARROW_FLAT
    else:
        return None
    return narrow if k + narrow + 1 < n_items else None


def _share_limit(k: int, wide: int) -> float:
    """The share of the items ``wide`` candidates a user of a search of ``k`` may be (where the pass compares
    float32 sums): MAX_CANDIDATE_SHARE, lower above LARGE_K, lower still beyond ONE_CHUNK_WIDE candidates."""
    if k <= LARGE_K:
        return MAX_CANDIDATE_SHARE
    return MAX_CANDIDATE_SHARE_LARGE_K if wide <= ONE_CHUNK_WIDE else MAX_CANDIDATE_SHARE_TWO_CHUNKS


def _within_share(engine: Any, wide: int) -> bool:
    """Whether ``wide`` candidates a user stay within MAX_CANDIDATE_SHARE_TILES16 of the catalogue (or the catalogue
    is under SHARE_MIN_ITEMS, where the share models do not act)."""
    return engine.n_items < SHARE_MIN_ITEMS or wide <= MAX_CANDIDATE_SHARE_TILES16 * engine.n_items


def _learned_pass(engine: Any, k: int, stats: dict, n_users: int) -> int | None:
    """The index of the widened pass whose margin a fast search of ``n_users`` at ``k`` (``stats``) teaches the next
    searches of k to start with: the first that certified more than WIDE_FIRST of the users, within the candidate
    share; None where its first pass certified WIDE_FIRST of them or more, or no widened pass did."""
    most = WIDE_FIRST * max(n_users, 1)
    for i, (margin, _, rescued) in enumerate(stats["widened_passes"]):
        if rescued > most:
            return i if _within_share(engine, k + margin + 1) else None
    return None


def _learn_margin(engine: Any, k: int, stats: dict, n_users: int, narrow: int | None = None) -> None:
    """After a fast search of ``n_users`` at ``k`` (``stats``): the next searches of k start with the margin of the
    widened pass that certified more than WIDE_FIRST of the users (``_learned_pass``), or with ``narrow`` (a sample's
    probe for a search of NARROW_MIN_USERS or more) where a first pass at it would have certified every user
    (``stats["narrow_certified"]``). Where neither, a search at the first margin forgets any learned one, and so does
    one at a narrowed margin that widened more than NARROW_MISS of its users; a search that started wider leaves it
    as it is (a sample's probe, at the first margin, finds out afresh)."""
    learned = _learned_pass(engine, k, stats, n_users)
    first, default = stats["first_margin"], _default_margin(engine, k)
    if learned is not None:
        engine._fast.margins[k] = stats["widened_passes"][learned][0]
    elif narrow is not None and stats.get("narrow_certified") == n_users:
        engine._fast.margins[k] = narrow
    elif first == default or (first < default and stats["widened_users"] > NARROW_MISS * n_users):
        engine._fast.margins.pop(k, None)


def _pass_share(engine: Any, n_users: int, k: int) -> float:
    """``Backend.float16_pass_share`` of a search of ``n_users`` at ``k``. A model only: it plans no pass (a plan
    here would be seen by ``recall tune`` as the search's first pass, and tune it instead of the float16 one)."""
    width = int(engine.prepared_items.shape[1])
    return engine.backend.float16_pass_share(n_users, engine.n_items, k, width, engine.options)


def _trust(engine: Any, k: int, stats: dict, n_users: int, share: float) -> None:
    """Remember whether a whole fast search of ``n_users`` at ``k`` paid (its modelled cost at most DECLINE_COST, at
    the first margin it teaches the next search), for the next search of that k: one large enough to sample skips
    its probe where it did (``trusted``), one too small to sample declines where it did not (``unpaid``)."""
    if _remember_cost(engine, k, stats, n_users, share):
        engine._fast.trusted.add(k)
    else:
        engine._fast.trusted.discard(k)


def _remember_cost(engine: Any, k: int, stats: dict, n_users: int, share: float) -> bool:
    """Whether a whole fast search of ``n_users`` at ``k`` paid; remembered for the next search of k too small to
    sample (``FastState.unpaid``, RECHECK_EVERY). A search too small to sample teaches nothing else: its users are too
    few to let a large search skip its probe."""
    paid = _taught_cost(engine, k, stats, n_users, share) <= DECLINE_COST
    if paid:
        engine._fast.unpaid.pop(k, None)
    else:
        _owe(engine, k)
    return paid


def _owe(engine: Any, k: int) -> None:
    """A fast search of ``k`` did not pay: the next ones too small to sample decline, until a recheck after
    RECHECK_EVERY of them, or twice as many as before where the last recheck did not pay either (RECHECK_MOST)."""
    unpaid = engine._fast.unpaid
    before = unpaid.get(k)
    unpaid[k] = (0, RECHECK_EVERY if before is None else min(2 * before[1], RECHECK_MOST))


def _owed(engine: Any, k: int, n_users: int) -> str | None:
    """Why a search of ``n_users`` too small to sample declines (RECHECK_EVERY): the engine's last fast search of
    ``k`` did not pay and no recheck is due (the search is counted); None where it runs fast mode."""
    debt = None if engine._fast is None or engine.options.fast_sample == 0 else engine._fast.unpaid.get(k)
    if debt is None or debt[0] + 1 >= debt[1]:
        return None
    engine._fast.unpaid[k] = (debt[0] + 1, debt[1])
    return (f"the engine's last fast search of k = {k} did not pay (too many of its users fell back to exact search "
            f"or were widened), and {n_users:,} users are too few to sample (under {SAMPLE_MIN * SAMPLE_DIVISOR:,}): "
            f"fast mode is tried again after {debt[1] - debt[0] - 2} more such searches")


def _declined_search(engine: Any, users: Any, k: int, excl: Exclusions, why: str) -> tuple[Any, Any]:
    """Exact mode's search of prepared ``users`` where fast mode declined before any pass, ``why`` in the stats."""
    vals, rows, run_stats = _search_exact(engine, users, k, excl)
    engine.stats = {**run_stats, "precision": "exact", "fallback_users": 0, "widened_users": 0,
                    "fallback_fraction": 0.0, "fast_declined": why}
    return vals, rows


def _search_exact(engine: Any, users: Any, k: int, excl: Exclusions, options: Any = None) -> tuple[Any, Any, dict]:
    """Exact mode's search of prepared ``users``: (scores, rows) backend arrays and the search's stats (``options``
    instead of the engine's)."""
    vals = engine.backend.empty_out((users.shape[0], k), np.float32, False)
    rows = engine.backend.empty_out((users.shape[0], k), np.int64, False)
    return vals, rows, engine.run(users, k, excl, vals, rows, options=options)()


def _sample_rows(n_users: int, most: int) -> np.ndarray | None:
    """Evenly spaced user rows to try fast mode on first, or None where the search is too small to sample."""
    size = min(most, n_users // SAMPLE_DIVISOR)
    if size < SAMPLE_MIN:
        return None
    return np.arange(size, dtype=np.int64) * n_users // size


def _take(xp: Any, users: Any, rows: np.ndarray) -> Any:
    """Rows ``rows`` (host int64) of host or backend ``users``."""
    return users[rows] if isinstance(users, np.ndarray) else users[xp.asarray(rows)]


def _prepare(engine: Any, users: Any, k: int, margin: int | None = None) -> certificate.FastUsers:
    """The float16 copies of prepared ``users`` and what their certificates need (module of ``users``), for a
    search of ``k`` whose first pass keeps ``margin`` more (default :func:`_default_margin`)."""
    backend = engine.backend
    uxp = np if isinstance(users, np.ndarray) else backend.xp
    # Where the pass keeps float16 score tiles, each user's scores are shifted near 0 (SHIFT_ITEMS). Where it keeps
    # float32 (a fused kernel, the CPU) they are not: a shift there adds its share to the accumulation term and to
    # the threshold sample's margin, and costs a float32 GEMM and its maxima (200k x 20k x 64 at k = 100: 1.8 ms of a
    # 27 ms search, H200, docs/benchmarks.md). It used to be applied where users hold bound or bias columns anyway
    # (no products added), for the threshold sample's block-a-user radix select, which ran faster on shifted scores
    # (1M x 100k x 64 at k = 100: 0.051 s of selects against 0.072 s) before it skipped the leading bits its keys
    # share; small ranks now take the warp-a-user select, whose bisection the scores' offset does not touch.
    half = _tiles16(engine, int(users.shape[0]), k, margin)
    shift = _sampled_best(engine, users, uxp, _first_wide(engine, k, margin)) if half else None
    return _prepare_users(engine, users, uxp, half, shift)


def _prepare_users(engine: Any, users: Any, uxp: Any, half: bool, shift: Any) -> certificate.FastUsers:
    """``certificate.prepare_users`` of prepared ``users`` (module ``uxp``): by the backend where they are its arrays
    (``Backend.fast_users``), else by NumPy."""
    backend, items = engine.backend, _state(engine).items
    if uxp is backend.xp:
        return backend.fast_users(users, items, half_scores=half, shift=shift)
    return certificate.prepare_users(uxp, users, items, half_scores=half, shift=shift)


def _tiles16(engine: Any, n_users: int, k: int, margin: int | None = None) -> bool:
    """Whether the first float16 pass of a search of ``n_users`` at ``k`` (keeping ``margin`` more, default
    :func:`_default_margin`) will keep float16 score tiles (``Backend.pass_score_dtype``), for users not shifted
    (their columns: ``FastItems.unshifted_width``)."""
    items = _state(engine).items
    wide = _first_wide(engine, k, margin)
    plan = _pass_plan(engine, n_users, wide)
    kept = engine.backend.pass_score_dtype(plan, n_users, engine.n_items, wide, items.unshifted_width, np.float16,
                                           engine.options)
    return np.dtype(kept) == np.float16


def _first_wide(engine: Any, k: int, margin: int | None = None) -> int:
    """The candidates a user the first float16 pass of a search at ``k`` keeps (``margin`` more than k, default
    :func:`_default_margin`, and one), at most every item."""
    return min(k + (_default_margin(engine, k) if margin is None else margin) + 1, engine.n_items)


def _pass_plan(engine: Any, n_users: int, wide: int) -> Any:
    """``Engine.plan`` of a float16 pass of ``n_users`` keeping ``wide`` candidates, from the shape and dtype of its
    users (a stand-in that holds no memory); made once a search (``FastState.plans``): ``_tiles16`` asks for it
    before the pass runs it (a plan took 0.1 ms of host time on the H100, three of them a search of the route,
    docs/benchmarks.md)."""
    state = _state(engine)
    plan = state.plans.get((n_users, wide))
    if plan is None:
        spec = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), (n_users, state.items.width), (0, 0))
        plan = state.plans[(n_users, wide)] = engine.plan(spec, engine.n_items, wide)
    return plan


def _search_fast(engine: Any, users: Any, k: int, excl: Exclusions,
                 fast_users: certificate.FastUsers | None = None, ordered: bool = False,
                 margin: int | None = None, narrow: int | None = None) -> tuple[Any, Any, dict]:
    """Fast mode on every one of ``users``: (scores, rows, stats), exactly exact mode's answer. ``fast_users``: their
    float16 copies (``_prepare``), when already made; ``ordered``: the certified route (``search``); ``margin``: the
    first pass's (default :func:`_default_margin`; the widened pass keeps WIDEN times as many); ``narrow``: a
    smaller margin whose first pass's certified users are counted too (``stats["narrow_certified"]``)."""
    backend = engine.backend
    xp = backend.xp
    state = _state(engine)
    uxp = np if isinstance(users, np.ndarray) else xp
    m = _default_margin(engine, k) if margin is None else margin
    if fast_users is None:
        fast_users = _prepare(engine, users, k, m)
    n_users, n_items = int(users.shape[0]), engine.n_items
    # The first pass starts where its sample says k + NEED_SLACK items lie above each user; at a margin learned wider
    # than the first (WIDE_FIRST: scores of a crowd closer than the certificate's bound), where its k + m + 1 do.
    need = k + NEED_SLACK if m <= certificate.margin(k) else k + m + 1
    vals, rows, failed, run_stats, n_cand = _certified_pass(engine, state, users, fast_users, k, k + m, excl,
                                                            ordered, estimate=True, narrow=narrow, need=need)
    half = _kept16(backend, run_stats)  # what the pass kept its scores in
    widened, passes, pass_m = failed, [], m
    # Once more with WIDEN times the margin; where score tiles are float16, each score shifted by the user's exact
    # k-th of the last pass: the scores that decide the certificate then lie near 0, where the tiles round them
    # least. Seeded from lower bounds only: a user whose first pass started above its k-th best (an estimate,
    # ``left_out``) gets every item it needs here. Then again WIDEN times wider (WIDENED_PASSES), as long as the
    # candidates stay within the share.
    while failed.size and k + pass_m < n_items and len(passes) < WIDENED_PASSES and (
            not passes or _within_share(engine, k + WIDEN * pass_m + 1)):
        pass_m *= WIDEN
        sel = xp.asarray(failed)
        sub = _take(xp, users, failed)
        shift = None
        if half:
            kth = vals[sel, k - 1]
            kth = backend.to_host(kth) if uxp is np else kth
            shift = uxp.where(uxp.isfinite(kth), kth, 0).astype(uxp.float64)
        retry = _prepare_users(engine, sub, uxp, half, shift)
        try:
            w_vals, w_rows, w_failed, _, _ = _certified_pass(engine, state, sub, retry, k, k + pass_m,
                                                             excl.subset(failed), ordered)
        except ResourceError:  # the budget holds no tile of this many candidates: exact mode for these users
            break
        vals[sel], rows[sel] = w_vals, w_rows
        passes.append([pass_m, int(failed.size), int(failed.size - w_failed.size)])
        failed = failed[w_failed]
    if failed.size:
        # The certified route's last resort is exact mode's fused kernel whatever the number of users (a search of
        # fewer than its tile of 128 would otherwise take cuBLAS, whose sums are in another order).
        forced = replace(engine.options, fused="force") if ordered else None
        fv, fr, _ = _search_exact(engine, _take(xp, users, failed), k, excl.subset(failed), forced)
        sel = xp.asarray(failed)
        vals[sel], rows[sel] = fv, fr
    stats = {**run_stats, "precision": "fast", "candidates": n_cand, "first_margin": m,
             "widened_users": int(widened.size), "widened_passes": passes,
             "fallback_users": int(failed.size), "fallback_fraction": failed.size / max(n_users, 1)}
    return vals, rows, stats


def _kept16(backend: Any, run_stats: dict) -> bool:
    """Whether a float16 pass kept its scores in float16 tiles, from its stats."""
    return np.dtype(run_stats.get("score_dtype", backend.score_dtype(np.float16))) == np.float16


def shift_rows(n_items: int, wide: int) -> np.ndarray:
    """The rows of the items a user's shift is the best score over, for a pass that keeps ``wide`` candidates a
    user: ``n_items // wide`` of them evenly spaced, at most SHIFT_ITEMS and at least one (int64)."""
    size = max(1, min(SHIFT_ITEMS, n_items // max(wide, 1)))
    return np.arange(size, dtype=np.int64) * n_items // size


def _sampled_best(engine: Any, users: Any, uxp: Any, wide: int) -> Any:
    """Per user (n,) float64 of module ``uxp``: the best float32 score over the items of :func:`shift_rows` (for a
    pass keeping ``wide``), computed on the backend."""
    backend = engine.backend
    xp = backend.xp
    sample = engine.prepared_items[xp.asarray(shift_rows(engine.n_items, wide))]
    n_users = int(users.shape[0])
    best = xp.empty(n_users, dtype=xp.float64)
    for start in range(0, n_users, _SHIFT_BLOCK):
        block = xp.asarray(users[start:start + _SHIFT_BLOCK])
        best[start:start + block.shape[0]] = (block @ sample.T).max(axis=1)
    return best if uxp is xp else backend.to_host(best)


def _certified_pass(engine: Any, state: FastState, users: Any, fast_users: certificate.FastUsers, k: int,
                    n_keep: int, excl: Exclusions, ordered: bool = False, estimate: bool = False,
                    narrow: int | None = None, need: int = 0) -> tuple[Any, Any, np.ndarray, dict, int]:
    """One float16 pass keeping ``n_keep`` candidates per user, their float32 re-scoring (``ordered``: the exact
    search's own sums) and the certificate: (scores, rows, host rows of the users whose certificate failed, the
    pass's stats, candidates per user). ``estimate``: the pass may start each user below its last candidate's
    score (``Backend.run_blocks``' ``left_out``: where its threshold sample says ``need`` items lie above, 0: all it
    keeps), which the certificate then counts as left out.

    ``narrow`` (a margin m' below ``n_keep - k``): the stats' ``narrow_certified`` counts the users a pass keeping
    k + m' would have certified (one that starts at the same estimate). A user's certificate there holds exactly
    where its exact k-th score here beats the bound of its (k + m' + 1)-th best approximate score: where it does,
    every item outside those k + m' + 1 scores below that k-th exactly, so they hold the k best and their exact k-th
    is this one; where that pass certifies, its k-th is the true k-th, which this pass's candidates hold too."""
    backend = engine.backend
    xp = backend.xp
    n_users, n_items = int(users.shape[0]), engine.n_items
    wide = min(n_keep + 1, n_items)
    approx_vals = backend.empty_out((n_users, wide), np.float32, False)
    approx_rows = backend.empty_out((n_users, wide), np.int64, False)
    # Where every item is a candidate there is nothing to estimate: the certificate has nothing left out.
    left = backend.empty_out((n_users,), np.float32, False) if estimate and wide < n_items else None
    # In no order (``best_first``): the re-scoring ranks the candidates itself, and the bound below takes the least.
    # A user whose pass holds its k best clear of its start is certified against it (the start counts as left out,
    # below), however few of the ``wide`` it holds.
    wait = engine.run(fast_users.vecs16, wide, excl, approx_vals, approx_rows, items=state.resident, left_out=left,
                      best_first=False, need=min(need, wide), plan=_pass_plan(engine, n_users, wide))
    # Every one of the ``wide`` kept is re-scored (one more than the certificate needs: which one is the least is
    # not known without a sort), queued behind the pass without waiting for it: on the H200 the host's wait and then
    # its launches left the GPU idle 0.8-1.5 ms between the two (docs/benchmarks.md).
    backend.queue_after(wait)
    cand_rows = approx_rows.reshape(-1)
    vals, rows, path = backend.rescore(users, engine.resident_items, wide, cand_rows, k, engine.memory_budget,
                                       engine.options, ordered)
    run_stats = {**wait(), "rescore_path": path}
    # The backend says what its scores were kept in: float16 score tiles (the GPU's cuBLAS path), or float32 (its
    # fused kernel, the CPU), which the certificate reads without the tiles' rounding.
    tiles16 = _kept16(backend, run_stats)
    if tiles16 != fast_users.half_scores:
        fast_users = replace(fast_users, half_scores=tiles16)
    if wide < n_items:
        # The best score left out is at most the pass's least kept one (an empty slot's -inf where it kept fewer),
        # or where it started above that (an estimate that held fewer than ``wide`` items above it), its start:
        # every item below it was left out.
        def certifies(least: Any) -> Any:
            outside = least if left is None else xp.where(left > least, left, least)
            return certificate.certified(xp, vals[:, k - 1], outside, fast_users, state.items)

        least = approx_vals.min(axis=1)
        failed, short = _failed_rows(backend, xp, ~certifies(least), None if left is None else left > least)
        if short is not None:
            run_stats = {**run_stats, "estimate_short_users": short}
        if narrow is not None and k + narrow + 1 < wide:
            held = certifies(-xp.sort(-approx_vals, axis=1)[:, k + narrow])  # the narrower pass's least kept score
            run_stats = {**run_stats, "narrow_certified": int(backend.to_host(held.sum()))}
    else:
        failed = np.zeros(0, np.int64)  # every item was a candidate: nothing left out to certify against
    return vals, rows, failed, run_stats, wide


def _failed_rows(backend: Any, xp: Any, failed: Any, short: Any = None) -> tuple[np.ndarray, int | None]:
    """(host int64 rows where the (n,) bool ``failed`` holds, how many of ``short`` (n,) bool, or None, hold), from
    one small transfer where no user failed: their count first, the rows only where there are some (1M users'
    flags fetched and scanned on the host cost 1.3 ms of GPU idle time at the end of the route,
    docs/benchmarks.md)."""
    counts = [failed.sum(dtype=xp.int64)] + ([] if short is None else [short.sum(dtype=xp.int64)])
    counts = backend.to_host(xp.stack(counts))
    n_failed = int(counts[0])
    n_short = None if short is None else int(counts[1])
    if n_failed == 0:
        return np.zeros(0, np.int64), n_short
    # Their rows by a scatter (a mask's own indexing would wait for the device outside ``to_host``): row r goes to
    # the number of failed rows before it; the rows that did not fail, to one slot past them.
    n = int(failed.shape[0])
    at = xp.where(failed, xp.cumsum(failed, dtype=xp.int64) - 1, n_failed)
    rows = xp.empty(n_failed + 1, xp.int64)
    rows[at] = xp.arange(n, dtype=xp.int64)
    return backend.to_host(rows[:n_failed]), n_short

