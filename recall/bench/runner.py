"""Run workloads x contenders: generate, prepare, warm up, time, check against the oracle, collect raw numbers.

Timing protocol, the same for every contender: ``prepare`` (index build, uploads) is outside the timed region; one
warm-up search (JIT compilation, cuBLAS heuristics, allocator pools); then ``repeat`` timed searches, each between two
device-wide synchronisations on the GPU, timed with ``time.perf_counter``. Where the slowest of them took more than
:data:`UNSTEADY` times the fastest, up to :data:`EXTRA_RUNS` more are timed, one at a time while that stays true (a
median of two is the mean of two: one slow first run would be half the headline). The median is the headline, every
run is kept. The answer of the last run is checked against the float64 oracle on a sample of users.

Workloads with exclusions: the exclusions are generated after the data (on its device), the oracle first answers the
sampled users without them, part of each sampled user's exclusions is replaced by items of that true top-k
(``exclusions.plant``), and the oracle then answers with them; that is the truth every contender is checked against.
Neither step is timed. End-to-end rows (``--e2e``) write the data once per file layout (``--layout``, see
``layouts.py``), with the exclusions as a Parquet of (user_id, item_ids), and time the job from those files.
"""
from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from recall import BackendUnavailable, InputError
from recall.core.errors import one_line

from . import ceilings as ceil
from . import contenders as cont
from . import env, oracle
from . import exclusions as excl_mod
from . import layouts as lay
from .workloads import Workload

UNSTEADY = 1.10
"""Timed runs of one contender spread more than this (slowest / fastest) are unsteady and get more runs."""
EXTRA_RUNS = 2
"""At most this many runs beyond ``repeat`` for an unsteady contender."""
_clock = time.perf_counter  # the timed region's clock (tests replace it)


class _GcPauses:
    """Seconds the interpreter's garbage collector ran (every generation) since :meth:`reset`, from
    ``gc.callbacks``: a timed run's ``gc_s``. A collection of the oldest generation walks every Python object of the
    process, the anchors' libraries' too, and can be part of one run and not of the next."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> "_GcPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


SCHEMA = 2
"""Version of the results.json layout.

2: every result row gains ``metric``, ``excl_per_user`` and ``cell``; end-to-end rows gain ``layout`` (one row per
``--layout``, each with its own ``vs_resident``); workloads gain ``metric``, ``kind_params``, ``excl_per_user``,
``excl_nnz``, ``exclusions_s`` and ``cell``; checks gain ``excluded_returned``; a matrix run adds ``matrix`` (the grid,
its cells and one summary row per cell). Every key of schema 1 is still there with the same meaning. Added within 2
(readers must not require them): rows' ``extra_runs`` (timed runs beyond ``repeat``) and ``gc_s`` (each timed run's
seconds of garbage collection); end-to-end rows for each precision of the engine's rows (contender ``recall-fast``:
the job in fast precision)."""


@dataclass
class Settings:
    """What to run. See ``recall bench --help`` for the meaning of each field."""

    workloads: list[Workload]
    device: str = "cpu"
    families: list[str] = field(default_factory=lambda: list(cont.FAMILIES))
    repeat: int = 3
    seed: int = 0
    sample_users: int = 1000
    metric: str = "ip"
    rtol: float = oracle.DEFAULT_RTOL
    measure_ceilings: bool = False
    e2e: bool = False
    memory_budget: int | None = None
    data: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Users' own (users, items) per workload name (``--users/--items``), used instead of generating."""
    layouts: list[str] = field(default_factory=lambda: [lay.DEFAULT])
    """File layouts of the end-to-end rows (``--layout``), one row each."""
    inexact: bool = True
    """Also run contenders that are not exact by design (torch-bf16); matrix runs leave them out."""
    max_seconds: float | None = None
    """Start no further workload once the run has taken this long (the rest are reported as skipped)."""

    def validate(self) -> None:
        """Raise InputError on values no run can use."""
        if self.device not in ("cpu", "gpu"):
            raise InputError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        if not isinstance(self.repeat, int) or self.repeat < 1:
            raise InputError(f"--repeat must be >= 1, got {self.repeat!r}")
        if not isinstance(self.sample_users, int) or self.sample_users < 1:
            raise InputError(f"--sample-users must be >= 1, got {self.sample_users!r}")
        if self.seed < 0:
            raise InputError(f"--seed must be >= 0, got {self.seed}")
        if self.metric not in ("ip", "cosine", "l2"):
            raise InputError(f"unknown metric {self.metric!r}: expected ip, cosine or l2")
        cont.parse_families(self.families)
        if not self.layouts:
            raise InputError("--layout: give at least one layout")
        for name in self.layouts:
            lay.get(name)
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise InputError(f"the time budget must be > 0 seconds, got {self.max_seconds!r}")


def _free_device_memory(device: str) -> None:
    gc.collect()
    if device != "gpu":
        return
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    try:
        import torch

        torch.cuda.empty_cache()
    except Exception:
        pass


def _row(w: Workload, c_name: str, family: str, device: str, exact: bool, mode: str = "kernel",
         metric: str = "ip") -> dict[str, Any]:
    return {"workload": w.name, "kind": w.kind_label, "device": device, "contender": c_name, "family": family,
            "mode": mode, "claims_exact": exact, "status": "ok", "reason": None, "n_users": w.n_users,
            "n_items": w.n_items, "dim": w.dim, "k": w.k, "prepare_s": None, "warmup_s": None, "times_s": [],
            "extra_runs": 0, "gc_s": [], "median_s": None, "users_per_s": None, "tflops": None, "check": None,
            "vs_faiss": None, "metric": metric, "excl_per_user": w.excl_per_user, "cell": w.cell}


def _finish_times(row: dict[str, Any], w: Workload) -> None:
    t = statistics.median(row["times_s"])
    row["median_s"] = t
    row["users_per_s"] = w.n_users / t if t > 0 else None
    row["tflops"] = w.flops / t / 1e12 if t > 0 else None
    row["gb_per_s"] = w.bytes_moved / t / 1e9 if t > 0 and w.bytes_moved else None  # memory-bound workloads (S5)


def _unsteady(times: list[float]) -> bool:
    return len(times) > 1 and max(times) > UNSTEADY * min(times)


def _timed_runs(times: list[float], repeat: int, once: Callable[[], float], gc_s: list[float] | None = None) -> int:
    """Append the times of ``repeat`` calls of ``once`` to ``times``, then of up to :data:`EXTRA_RUNS` more, one at a
    time while the runs are unsteady; return how many more. ``gc_s`` gets, per call, the seconds the garbage collector
    ran during it."""
    with _GcPauses() as pauses:
        while len(times) < repeat or (len(times) < repeat + EXTRA_RUNS and _unsteady(times)):
            pauses.reset()
            times.append(once())
            if gc_s is not None:
                gc_s.append(pauses.seconds)
    return len(times) - repeat


def _time_contender(c: cont.Contender, w: Workload, users: Any, items: Any, truth: oracle.Truth, s: Settings,
                    log: Callable[[str], None], excl: Any = None, metric: str = "ip") -> dict[str, Any]:
    row = _row(w, c.name, c.family, s.device, c.exact, metric=metric)
    # Only workloads with exclusions (or a shared filter) pass them: a contender written for plain searches still
    # runs the rest.
    if truth.allowed is not None:
        def search() -> Any:
            return c.search(users, w.k, allow=truth.allowed)
    elif excl is not None:
        def search() -> Any:
            return c.search(users, w.k, exclude=excl)
    else:
        def search() -> Any:
            return c.search(users, w.k)
    reason = c.unavailable() or c.unsupported(w.k, w.n_items) or c.check_workload(w)
    if reason:
        row.update(status="skipped", reason=reason)
        log(f"  {c.name}: skipped ({reason})")
        return row
    try:
        t0 = _clock()
        c.prepare(items)
        c.sync()
        row["prepare_s"] = _clock() - t0
        t0 = _clock()
        search()
        c.sync()
        row["warmup_s"] = _clock() - t0
        answer = None

        def timed() -> float:
            nonlocal answer
            answer = None  # let the previous answer's memory go before the next search allocates its own
            c.sync()
            t0 = _clock()
            answer = search()
            c.sync()
            return _clock() - t0

        row["extra_runs"] = _timed_runs(row["times_s"], s.repeat, timed, row["gc_s"])
        _finish_times(row, w)
        row["engine_stats"] = c.stats()  # e.g. GPU busy time / wall time of the last timed search
        indices, scores = answer
        row["check"] = w.check(truth, users, items, indices, scores, rtol=s.rtol).as_dict()
        within = row["check"].get("users_within_rounding")
        log(f"  {c.name}: median {row['median_s']:.4g} s, recall@{w.k} {row['check']['recall']:.4f}"
            + (f" ({within} sampled users' top k within float32's rounding: unchecked)" if within else ""))
    except (BackendUnavailable, ImportError) as exc:
        row.update(status="skipped", reason=f"{type(exc).__name__}: {exc}")
        log(f"  {c.name}: skipped ({row['reason']})")
    except Exception as exc:  # one contender failing must not lose the others' numbers
        row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
        log(f"  {c.name}: ERROR {row['reason']}")
    finally:
        answer = None
        c.release()
        _free_device_memory(s.device)
    return row


def _write_parquet(vecs: np.ndarray, path: Path, layout: str = lay.DEFAULT) -> None:
    """Embeddings Parquet (``id`` = row number, ``embedding``) in one of ``layouts.LAYOUTS``."""
    lay.write(vecs, path, layout)


def _read_candidates(path: Path, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, scores) of the sampled users from a candidates Parquet whose user and item ids are row numbers.

    Users missing from the file get a row of padding (-1, -inf), which the oracle counts as misses.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["user_id", "item_ids", "scores"])
    user_ids = t.column("user_id").to_numpy()
    order = np.argsort(user_ids, kind="stable")
    if user_ids.size == 0:
        found, pos = np.zeros(rows.size, dtype=bool), np.zeros(rows.size, dtype=np.int64)
    else:
        pos = np.minimum(np.searchsorted(user_ids[order], rows), user_ids.size - 1)
        found = user_ids[order[pos]] == rows
    # Only the sampled users' lists are materialised: a 100,000 x 1,000 file stays in Arrow.
    sub = t.take(pa.array(order[pos[found]]))
    items_col = sub.column("item_ids").combine_chunks()
    scores_col = sub.column("scores").combine_chunks()
    offsets = items_col.offsets.to_numpy()
    flat_items = items_col.values.to_numpy(zero_copy_only=False).astype(np.int64)
    flat_scores = scores_col.values.to_numpy(zero_copy_only=False).astype(np.float64)
    idx = np.full((rows.size, k), -1, dtype=np.int64)
    sc = np.full((rows.size, k), -np.inf, dtype=np.float64)
    for j, r in enumerate(np.flatnonzero(found)):
        a, b = int(offsets[j]), min(int(offsets[j + 1]), int(offsets[j]) + k)
        idx[r, :b - a] = flat_items[a:b]
        sc[r, :b - a] = flat_scores[a:b]
    return idx, sc


def _e2e(w: Workload, users: Any, items: Any, truth: oracle.Truth, s: Settings, log: Callable[[str], None],
         metric: str = "ip", excl: Any = None, precisions: Any = (None,)) -> list[dict[str, Any]]:
    """Parquet to Parquet through ``recall.jobs.score_files``, once per layout of ``s.layouts`` and engine precision
    of ``precisions`` (None: the job's default), with the files in the page cache; the exclusions (if any) go in as a
    Parquet of (user_id, item_ids)."""
    from recall.jobs import score_files

    rows = []
    with tempfile.TemporaryDirectory(prefix="recall-bench-e2e-") as tmp:
        tmp_path = Path(tmp)
        host_users, host_items = oracle.to_host(users), oracle.to_host(items)
        excl_path = None
        if excl is not None:
            excl_path = tmp_path / "exclusions.parquet"
            lay.write_exclusions(*excl.host(), excl_path)
        for layout in s.layouts:
            for precision in precisions:
                rows.append(_e2e_layout(w, host_users, host_items, items, truth, s, log, metric, layout, tmp_path,
                                        excl_path, score_files, precision))
    return rows


def _e2e_layout(w: Workload, host_users: np.ndarray, host_items: np.ndarray, items: Any, truth: oracle.Truth,
                s: Settings, log: Callable[[str], None], metric: str, layout: str, tmp_path: Path,
                excl_path: Path | None, score_files: Callable[..., Any],
                precision: str | None = None) -> dict[str, Any]:
    name = cont.recall_name(precision)
    row = _row(w, name, "recall", s.device, True, mode="e2e", metric=metric)
    row["layout"] = layout
    try:
        users_path, items_path = tmp_path / f"users-{layout}.parquet", tmp_path / f"items-{layout}.parquet"
        _write_parquet(host_users, users_path, layout)
        _write_parquet(host_items, items_path, layout)
        row["input_bytes"] = users_path.stat().st_size + items_path.stat().st_size

        def once(out: Path) -> float:
            kwargs: dict[str, Any] = {"metric": metric, "device": s.device, "memory_budget": s.memory_budget}
            if precision is not None:
                kwargs["precision"] = precision
            if excl_path is not None:
                kwargs["exclude_path"] = str(excl_path)
            t0 = _clock()
            summary = score_files(str(users_path), str(items_path), str(out), w.k, **kwargs)
            wall = _clock() - t0
            # The job's own stage times (they overlap) and the device's busy time, of the last run.
            row["stages"] = {"wall_s": wall, "start_s": summary.start_s, "early_users": summary.early_users,
                             "read_s": summary.read_s,
                             "search_s": summary.search_s,
                             "write_s": summary.write_s, "device_busy_s": summary.device_busy_s,
                             "batch_size": summary.batch_size}
            return wall

        row["warmup_s"] = once(tmp_path / "warmup.parquet")
        os.remove(tmp_path / "warmup.parquet")
        out = tmp_path / "out.parquet"

        def timed() -> float:
            if out.exists():
                os.remove(out)
            return once(out)

        row["extra_runs"] = _timed_runs(row["times_s"], s.repeat, timed, row["gc_s"])
        _finish_times(row, w)
        row["output_bytes"] = out.stat().st_size
        idx, sc = _read_candidates(out, truth.rows, w.k)
        row["check"] = oracle.check(truth, items, idx, sc, rtol=s.rtol, rows_are_sampled=True).as_dict()
        for p in (users_path, items_path, out):
            os.remove(p)
        log(f"  {name} e2e ({layout}): median {row['median_s']:.4g} s, recall@{w.k} {row['check']['recall']:.4f}")
    except Exception as exc:
        row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
        log(f"  {name} e2e ({layout}): ERROR {row['reason']}")
    return row


def _same_cell(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["workload"] == b["workload"] and a["kind"] == b["kind"] and a.get("metric") == b.get("metric")


def _ratios(rows: list[dict[str, Any]]) -> None:
    """vs_faiss = FAISS median time / contender median time, within the same workload, device and mode (the
    GpuIndexFlat row, else knn_gpu); for an end-to-end row (one per file layout and precision), vs_resident = its
    median / the median of the engine's own search of resident data in that precision (the row of the same
    contender and workload), the cost of the files around the search."""
    for r in rows:
        if r["mode"] != "kernel":
            # An end-to-end job and a resident-data kernel are different things to compare with FAISS.
            own = next((b for b in rows if b["contender"] == r["contender"] and b["mode"] == "kernel"
                        and _same_cell(r, b) and b["median_s"]), None)
            if own is not None and r["median_s"]:
                r["vs_resident"] = r["median_s"] / own["median_s"]
            continue
        faiss_rows = [b for b in rows if b["family"] == "faiss" and b["mode"] == "kernel" and _same_cell(r, b)
                      and b["median_s"]]
        base = next((b for b in faiss_rows if b["contender"] == "faiss"), faiss_rows[0] if faiss_rows else None)
        if base is not None and r["median_s"]:
            r["vs_faiss"] = base["median_s"] / r["median_s"]


def _skip_all(w: Workload, built: list[cont.Contender], s: Settings, reason: str, metric: str) -> list[dict[str, Any]]:
    rows = []
    for c in built:
        row = _row(w, c.name, c.family, s.device, c.exact, metric=metric)
        row.update(status="skipped", reason=reason)
        rows.append(row)
    return rows


def _workload_info(w: Workload, s: Settings, metric: str, ceilings: dict[str, Any] | None) -> dict[str, Any]:
    params = w.kind_params
    return {"name": w.name, "kind": w.kind_label, "n_users": w.n_users, "n_items": w.n_items, "dim": w.dim,
            "k": w.k, "flops": w.flops, "status": "ok", "reason": None,
            "floors": ceil.floors(w.n_users, w.n_items, w.dim, ceilings) if s.device == "gpu" else None,
            "metric": metric, "kind_params": None if params is None else dict(vars(params)),
            "excl_per_user": w.excl_per_user, "excl_nnz": None, "exclusions_s": None, "cell": w.cell}


def _truth_and_exclusions(w: Workload, users: Any, items: Any, s: Settings, metric: str,
                          winfo: dict[str, Any]) -> tuple[oracle.Truth, Any]:
    """The oracle's answer for the sampled users and the workload's exclusions (None without), timed into winfo."""
    t0 = time.perf_counter()
    rows = oracle.sample_rows(w.n_users, s.sample_users, s.seed)
    winfo["n_sample"] = int(rows.size)
    excl = None
    if w.excl_per_user:
        excl = w.exclusions(users, items, s.seed, metric)
        # The sampled users' true top-k without exclusions, so that their exclusions can include some of it.
        plain = w.truth(users, items, rows, metric=metric)
        excl = excl_mod.plant(excl, rows, plain.top_items, s.seed)
        cont.synchronize(s.device)
        winfo["excl_nnz"] = excl.nnz
        winfo["exclusions_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
    truth = w.truth(users, items, rows, metric=metric, exclude=excl, allowed=w.allowed(s.seed))
    winfo["oracle_s"] = time.perf_counter() - t0
    return truth, excl


def run(s: Settings, log: Callable[[str], None] = lambda msg: None, argv: list[str] | None = None,
        checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every workload of ``s`` against every contender and return the results document (see results.json).

    Parameters
    ----------
    s : Settings
    log : callable
        Receives one-line progress messages.
    argv : list of str, optional
        The command line, recorded in the results.
    checkpoint : callable, optional
        Receives the results document after every workload, so that a contender that kills the process (a native
        crash in a baseline library) leaves the finished workloads behind.

    Raises
    ------
    InputError
        Invalid settings.
    BackendUnavailable
        ``device="gpu"`` (or ``measure_ceilings``) without a usable GPU.
    """
    s.validate()
    started = time.perf_counter()
    if s.device == "gpu":
        reason = cont._gpu_reason()
        if reason:
            raise BackendUnavailable(f"--device gpu: no usable GPU: {reason}")
    environment = env.collect(s.device)
    ceilings = None
    if s.measure_ceilings:
        log("measuring ceilings (matmul rates, copy bandwidth)")
        ceilings = ceil.measure()
    elif s.device == "gpu":
        ceilings = ceil.defaults_for(environment.get("gpu"))
    doc: dict[str, Any] = {
        "schema": SCHEMA, "command": argv, "environment": environment,
        "settings": {"device": s.device, "families": list(s.families), "repeat": s.repeat, "seed": s.seed,
                     "sample_users": s.sample_users, "metric": s.metric, "rtol": s.rtol, "e2e": s.e2e,
                     "layouts": list(s.layouts), "memory_budget": s.memory_budget, "max_seconds": s.max_seconds,
                     "timing": "perf_counter between device-wide synchronisations; "
                     f"median of repeats (up to {EXTRA_RUNS} more where the slowest took over {UNSTEADY}x the fastest) "
                     "after one warm-up; prepare (index build, upload) not timed"},
        "ceilings": ceilings, "workloads": [], "results": [],
    }
    built_for: dict[str, list[cont.Contender]] = {}
    for w in s.workloads:
        metric = w.metric or s.metric
        if metric not in built_for:
            built_for[metric] = cont.build(s.families, s.device, metric, s.memory_budget, inexact=s.inexact)
        built = built_for[metric]
        winfo = _workload_info(w, s, metric, ceilings)
        doc["workloads"].append(winfo)
        log(f"{w.name}: {w.n_users:,} users x {w.n_items:,} items x {w.dim}, k={w.k}, {w.kind_label}, {metric}"
            + (f", {w.excl_per_user} exclusions per user" if w.excl_per_user else "") + f", {s.device}")
        reason = w.unsupported
        if not reason and s.max_seconds is not None and time.perf_counter() - started > s.max_seconds:
            reason = f"time budget of {s.max_seconds:g} s spent before this workload"
        if reason:
            winfo.update(status="skipped", reason=reason)
            log(f"  skipped: {reason}")
            doc["results"].extend(_skip_all(w, built, s, reason, metric))
            continue
        t0 = time.perf_counter()
        if w.name in s.data:
            users, items = s.data[w.name]
        else:
            users, items = w.generate(s.seed, s.device)
        cont.synchronize(s.device)
        winfo["generate_s"] = time.perf_counter() - t0
        truth, excl = _truth_and_exclusions(w, users, items, s, metric, winfo)
        results = [_time_contender(c, w, users, items, truth, s, log, excl, metric) for c in built]
        if s.e2e and not (w.candidates or w.interests):  # score_files runs full single-vector searches
            # One job per precision the engine runs here: fast mode's job (host batches) is not its resident search.
            precisions = [c.precision for c in built if isinstance(c, cont.RecallContender)] or [None]
            results.extend(_e2e(w, users, items, truth, s, log, metric, excl, precisions))
        _ratios(results)
        doc["results"].extend(results)
        del users, items, truth, excl
        _free_device_memory(s.device)
        if checkpoint is not None:
            checkpoint(doc)
    doc["elapsed_s"] = time.perf_counter() - started
    return doc


def problems(doc: dict[str, Any]) -> list[str]:
    """Lines naming every contender that errored, or that claims exactness and missed (recall < 1)."""
    out = []
    for r in doc["results"]:
        if r["status"] == "error":
            out.append(f"{r['workload']}/{r['contender']} ({r['mode']}): {r['reason']}")
        elif r["status"] == "ok" and r["claims_exact"] and r["check"] and not r["check"]["exact"]:
            out.append(f"{r['workload']}/{r['contender']} ({r['mode']}): not exact, recall@{r['k']} "
                       f"{r['check']['recall']:.6f} ({r['check']['users_short']} of {r['check']['n_sample']} "
                       "sampled users short)")
    return out


def load_parquet_workload(users_path: Path, items_path: Path, k: int, device: str, id_col: str = "id",
                          vec_col: str = "embedding") -> tuple[Workload, tuple[Any, Any]]:
    """A workload from a user's own embedding files, and its (users, items) on ``device``.

    Raises
    ------
    InputError
        Missing file or column, vectors of unequal or mismatched dimension, nulls, k < 1.
    BackendUnavailable
        ``device="gpu"`` without a usable GPU (said before the files are read).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"--k must be an integer >= 1 with --users/--items, got {k!r}")
    if device == "gpu":
        reason = cont._gpu_reason()
        if reason:
            raise BackendUnavailable(f"--device gpu: no usable GPU: {reason}")
    users = _read_vectors(Path(users_path), vec_col)
    items = _read_vectors(Path(items_path), vec_col)
    if users.shape[1] != items.shape[1]:
        raise InputError(f"{users_path}: dimension {users.shape[1]} does not match {items_path}: {items.shape[1]}")
    if device == "gpu":
        import cupy

        users, items = cupy.asarray(users), cupy.asarray(items)
    name = f"{Path(users_path).stem}x{Path(items_path).stem}"
    # The data kind of a user's own files is unknown: "file" in the report says so.
    w = Workload(name, int(users.shape[0]), int(items.shape[0]), int(users.shape[1]), k, "file", device,
                 f"{users_path} x {items_path}")
    return w, (users, items)


def _read_vectors(path: Path, vec_col: str) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a Parquet file")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        names = pq.read_schema(path).names
        if vec_col not in names:
            raise InputError(f"{path}: no column {vec_col!r} (columns: {', '.join(names) or 'none'})")
        col = pq.read_table(path, columns=[vec_col]).column(vec_col).combine_chunks()
    except (KeyError, pa.ArrowInvalid) as exc:
        # Arrow's messages run over several lines (a schema dump); the CLI prints one.
        raise InputError(f"{path}: cannot read column {vec_col!r}: {one_line(exc)}") from None
    if not (pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type)
            or pa.types.is_large_list(col.type)):
        raise InputError(f"{path}: column {vec_col!r} has type {col.type}, expected a list of floats")
    if col.null_count:
        row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(f"{path}: row {row} has a null vector")
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    if lengths.size == 0:
        raise InputError(f"{path}: no rows")
    if (lengths != lengths[0]).any():
        row = int(np.argmax(lengths != lengths[0]))
        raise InputError(f"{path}: row {row} has dimension {lengths[row]}, expected {lengths[0]}")
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.float32)
    vecs = flat.reshape(lengths.size, int(lengths[0]))
    if not np.isfinite(vecs).all():
        row = int(np.argmax(~np.isfinite(vecs).all(axis=1)))
        raise InputError(f"{path}: row {row} has a NaN or infinite value")
    return vecs
