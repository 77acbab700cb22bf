"""Fast precision: score float16 copies on tensor cores, re-rank the best candidates in float32, prove the answer.

For every user the engine keeps the ``k + m + 1`` best *approximate* scores (m = ``certificate.margin(k)``),
re-scores the first ``k + m`` candidates in float32 (``Backend.rescore``) and takes their exact top k. The answer is
certified when the exact k-th score beats the best approximate score left out by more than the user's error bound
(``recall.core.certificate``); users whose certificate fails are searched again in exact mode, so the result is
always the exact answer. ``engine.stats["fallback_users"]`` counts them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core import certificate
from ..core.exclusions import Exclusions


@dataclass
class FastState:
    """What a fast engine prepares once: the float16 items (resident) and the norms the bound needs."""

    items: certificate.FastItems
    resident: Any  # the backend's resident form of items.vecs16


def _state(engine: Any, items: Any) -> FastState:
    if engine._fast is None:
        backend = engine.backend
        fast_items = certificate.prepare_items(backend.xp, items)
        engine._fast = FastState(fast_items, backend.load_items(fast_items.vecs16))
    return engine._fast


def search(engine: Any, users: Any, k: int, excl: Exclusions) -> tuple[Any, Any]:
    """Fast mode's search of prepared ``users`` (n, dim) float32 (host or backend): (scores, rows) (n, k) backend
    arrays, inner-product space, exactly exact mode's answer; sets ``engine.stats``."""
    backend = engine.backend
    xp = backend.xp
    state = _state(engine, engine.prepared_items)
    items16 = state.items
    uxp = np if isinstance(users, np.ndarray) else xp
    half = backend.score_dtype(np.float16) == np.float16
    users16, alpha, bound = certificate.prepare_users(uxp, users, items16, half_scores=half)
    n_users, n_items = int(users.shape[0]), engine.n_items
    wide = min(k + certificate.margin(k) + 1, n_items)
    approx_vals = backend.empty_out((n_users, wide), np.float32, False)
    approx_rows = backend.empty_out((n_users, wide), np.int64, False)
    run_stats = engine.run(users16, wide, excl, approx_vals, approx_rows, items=state.resident)()
    if half:
        # The GEMM scaled the scores by the output scale of the scored width (l2's augmented vectors included).
        approx_vals /= np.float32(certificate.output_scale(int(users16.shape[1])))
    n_cand = wide - 1 if wide < n_items else wide
    cand_rows = xp.ascontiguousarray(approx_rows[:, :n_cand]).reshape(-1)
    vals, rows, _ = backend.rescore(users, engine.resident_items, np.arange(n_users + 1, dtype=np.int64) * n_cand,
                                    cand_rows, k, engine.memory_budget, engine.options)
    if wide < n_items:
        ok = certificate.certified(xp, vals[:, k - 1], approx_vals[:, wide - 1], xp.asarray(alpha), items16.scale,
                                   xp.asarray(bound))
        failed = np.flatnonzero(backend.to_host(~ok))
    else:
        failed = np.zeros(0, np.int64)  # every item was a candidate: nothing left out to certify against
    if failed.size:
        users_failed = users[failed] if uxp is np else users[xp.asarray(failed)]
        fv = backend.empty_out((failed.size, k), np.float32, False)
        fr = backend.empty_out((failed.size, k), np.int64, False)
        engine.run(users_failed, k, excl.subset(failed), fv, fr)()
        sel = xp.asarray(failed)
        vals[sel], rows[sel] = fv, fr
    engine.stats = {**run_stats, "precision": "fast", "candidates": n_cand, "fallback_users": int(failed.size),
                    "fallback_fraction": failed.size / n_users}
    return vals, rows
