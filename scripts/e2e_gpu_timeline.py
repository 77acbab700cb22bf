"""Where the time of a GPU ``recall score`` job goes: a timeline of the start-up and of every batch.

``score_files`` on the GPU runs a reader thread (decoding user batches), the calling thread (queuing each batch's
search with ``Engine.search_async``) and a writer thread (waiting for each result, converting it to Arrow, writing
it). The bench's end-to-end row says how far its wall time is from the resident search; this says why:

* the start-up, stage by stage (file inspection, the items' decode and upload, engine construction, the user ids);
* per search (a batch against all the items, or against one part of them while they load: recall/early.py), on the
  host: when it was queued (and how long queuing took), when the writer began waiting for it, when it had its
  results;
* per search, on the device (events on the engine's compute stream before and after it is queued, timed against
  one reference event): when the device reached it, when it finished it, its busy time from the engine's stats.
  "late" is the device idle between the previous batch's end and this one's start because the host had not queued
  it yet; "inside" is idle within the batch's span that its blocks' busy time does not cover (staging waits, the
  item transpose and threshold sample before the blocks).

The inputs are the bench's S4 (``clustered``, seeded) written with pyarrow's defaults, as ``recall bench --e2e`` does.

Usage, from the project root on a GPU machine::

    PYTHONPATH=. python scripts/e2e_gpu_timeline.py [--workload S4] [--repeat 2] [--json PATH] \
        [--env RECALL_EARLY=off --env RECALL_EARLY_PARTS=8 ...]

Prints each set's walls and summary, then the last run's table; the JSON (default ``$OUT/e2e_timeline.json``) holds
every run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import cupy

from recall import pipeline
from recall.bench import workloads
from recall.bench.runner import _write_parquet
from recall.engine import Engine, PendingSearch
from recall.io import CandidateWriter


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.batches: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.ref: Any = None  # (cupy event, host time it completed)
        self.engines: list[Engine] = []  # in construction order: the full engine, and any part engines (early.py)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def span(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            a = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.spans.setdefault(name, []).append((a, self.now()))
        return timed

    def gpu_mark(self, engine: Engine) -> Any:
        stream = engine.backend.compute_stream
        ev = cupy.cuda.Event()
        ev.record(stream)
        if self.ref is None:
            ev.synchronize()
            self.ref = (ev, self.now())
        return ev

    def queue(self, engine: Engine, n_users: int, start: Any) -> tuple[Any, dict]:
        """Run ``start()`` (which queues a search on ``engine``) between two marks; (its result, the record)."""
        before = self.gpu_mark(engine)
        a = self.now()
        out = start()
        b = self.now()
        rec = {"users": n_users, "queue": (a, b), "gpu": (before, self.gpu_mark(engine)), "engine": engine}
        with self.lock:
            self.batches.append(rec)
        return out, rec

    def gpu_time(self, ev: Any) -> float:
        ev.synchronize()
        return self.ref[1] + cupy.cuda.get_elapsed_time(self.ref[0], ev) / 1e3


class _Timed:
    """A queued part search (``Engine._queue_on_device``) whose wait is recorded."""

    def __init__(self, queued: Any, rec: dict, engine: Engine, tl: Timeline) -> None:
        self.vals, self.rows = queued.vals, queued.rows
        self._queued, self._rec, self._engine, self._tl = queued, rec, engine, tl

    def __call__(self) -> Any:
        t0 = self._tl.now()
        out = self._queued()
        self._rec.setdefault("wait", (t0, self._tl.now()))
        self._rec["busy"] = self._engine.stats.get("gpu_busy_s", 0.0)
        return out


def run(users_path: Path, items_path: Path, out: Path, k: int) -> dict[str, Any]:
    tl = Timeline()
    init = Engine.__init__
    search_async = Engine.search_async
    result = PendingSearch.result

    def engine_init(self: Engine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        with tl.lock:
            tl.engines.append(self)

    def queued(self: Engine, users: Any, kk: int, exclude: Any = None) -> PendingSearch:
        pending, rec = tl.queue(self, len(users), lambda: search_async(self, users, kk, exclude))
        pending._timeline = rec  # noqa: SLF001 - the script's own bookkeeping
        return pending

    queue_on_device = Engine._queue_on_device

    def queued_part(self: Engine, users: Any, kk: int, floor: Any = None) -> Any:
        queued, rec = tl.queue(self, len(users), lambda: queue_on_device(self, users, kk, floor))
        return _Timed(queued, rec, self, tl)

    def waited(self: PendingSearch) -> Any:
        rec = getattr(self, "_timeline", None)
        a = tl.now()
        r = result(self)
        if rec is not None and "wait" not in rec:
            rec["wait"] = (a, tl.now())
            rec["busy"] = rec["engine"].stats.get("gpu_busy_s", 0.0)
        return r

    with ExitStack() as stack:
        patch = mock.patch.object
        stack.enter_context(patch(pipeline, "inspect_embeddings", tl.span("inspect", pipeline.inspect_embeddings)))
        stack.enter_context(patch(pipeline, "read_embeddings", tl.span("items read + upload",
                                                                       pipeline.read_embeddings)))
        stack.enter_context(patch(pipeline, "read_ids", tl.span("user ids (thread)", pipeline.read_ids)))
        stack.enter_context(patch(Engine, "__init__", tl.span("engine construction", engine_init)))
        stack.enter_context(patch(Engine, "search_async", queued))
        stack.enter_context(patch(PendingSearch, "result", waited))
        stack.enter_context(patch(Engine, "_queue_on_device", queued_part))
        stack.enter_context(patch(CandidateWriter, "write", tl.span("write", CandidateWriter.write)))
        stack.enter_context(patch(CandidateWriter, "commit", tl.span("commit", CandidateWriter.commit)))
        summary = pipeline.score_files(str(users_path), str(items_path), str(out), k, device="gpu")
    wall = tl.now()

    rows = []
    prev_end = None
    for i, rec in enumerate(sorted(tl.batches, key=lambda r: r["queue"][0])):
        g0, g1 = tl.gpu_time(rec["gpu"][0]), tl.gpu_time(rec["gpu"][1])
        late = max(0.0, g0 - prev_end) if prev_end is not None else 0.0
        rows.append({"search": i, "engine": tl.engines.index(rec["engine"]), "users": rec["users"],
                     "queue_start": rec["queue"][0], "queue_s": rec["queue"][1] - rec["queue"][0], "gpu_start": g0,
                     "gpu_end": g1, "busy_s": rec.get("busy", 0.0), "late_s": late,
                     "inside_idle_s": max(0.0, (g1 - g0) - rec.get("busy", 0.0)),
                     "wait_start": rec.get("wait", (0, 0))[0], "result_at": rec.get("wait", (0, 0))[1]})
        prev_end = max(prev_end or g1, g1)
    first_gpu = min((r["gpu_start"] for r in rows), default=wall)
    last_gpu = max((r["gpu_end"] for r in rows), default=wall)
    covered, end = 0.0, first_gpu  # union of the searches' device spans
    for r in sorted(rows, key=lambda r: r["gpu_start"]):
        covered += max(0.0, r["gpu_end"] - max(end, r["gpu_start"]))
        end = max(end, r["gpu_end"])
    return {
        "wall_s": wall, "start_s": summary.start_s, "early_users": summary.early_users,
        "batch_size": summary.batch_size, "engines": len(tl.engines),
        "spans": {k_: v for k_, v in tl.spans.items()}, "searches": rows,
        "before_first_gpu_s": first_gpu, "after_last_gpu_s": wall - last_gpu,
        "gpu_span_s": last_gpu - first_gpu, "covered_s": covered, "busy_s": sum(r["busy_s"] for r in rows),
        "late_s": sum(r["late_s"] for r in rows), "inside_idle_s": sum(r["inside_idle_s"] for r in rows),
    }


def report(r: dict[str, Any]) -> str:
    lines = [f"wall {r['wall_s']:.3f} s; start-up {r['start_s']:.3f} s ({r['early_users']:,} users searched "
             f"meanwhile, {r['engines']} engines); batch {r['batch_size']:,} users; {len(r['searches'])} searches",
             f"before the first search reaches the device {r['before_first_gpu_s']:.3f} s; device span "
             f"{r['gpu_span_s']:.3f} s (covered by searches {r['covered_s']:.3f}, blocks busy {r['busy_s']:.3f}, "
             f"idle waiting for the host {r['late_s']:.3f}, idle inside searches {r['inside_idle_s']:.3f}); after "
             f"the last search {r['after_last_gpu_s']:.3f} s",
             "", "| stage | start s | end s | busy s |", "| --- | ---: | ---: | ---: |"]
    for name, spans in r["spans"].items():
        lines.append(f"| {name} ({len(spans)}) | {spans[0][0]:.3f} | {spans[-1][1]:.3f} | "
                     f"{sum(b - a for a, b in spans):.3f} |")
    lines += ["", "| search | engine | users | queued at | queue s | device start | device end | busy s | late s | "
              "inside idle s | writer waits from | result at |", "| " + " | ".join(["---:"] * 12) + " |"]
    for b in r["searches"]:
        lines.append(f"| {b['search']} | {b['engine']} | {b['users']} | {b['queue_start']:.3f} | {b['queue_s']:.4f} | "
                     f"{b['gpu_start']:.3f} | {b['gpu_end']:.3f} | {b['busy_s']:.4f} | {b['late_s']:.4f} | "
                     f"{b['inside_idle_s']:.4f} | {b['wait_start']:.3f} | {b['result_at']:.3f} |")
    return "\n".join(lines)


def decode_times(path: Path) -> dict[str, float]:
    """Seconds to decode the file with pyarrow alone, no conversion: whole, and in the reader's batches."""
    import pyarrow.parquet as pq

    def whole() -> None:
        pq.ParquetFile(path, pre_buffer=True).read(columns=["id", "embedding"])

    def batched() -> None:
        for _ in pq.ParquetFile(path, pre_buffer=True).iter_batches(65_536, columns=["id", "embedding"]):
            pass

    def vectors_only() -> None:
        pq.ParquetFile(path, pre_buffer=True).read(columns=["embedding"])

    out = {}
    for name, fn in (("read", whole), ("iter_batches", batched), ("read embedding only", vectors_only)):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="S4")
    parser.add_argument("--repeat", type=int, default=2, help="runs; the first warms up, the last is printed")
    parser.add_argument("--env", action="append", help="KEY=VALUE[,KEY=VALUE]: environment of a set of runs "
                        "(repeatable: one set each, on the same files)")
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "e2e_timeline.json")
    args = parser.parse_args()
    w = workloads.get(args.workload)
    users, items = w.generate(seed=0, device="cpu")
    runs = []
    with tempfile.TemporaryDirectory(prefix="recall-timeline-") as tmp:
        users_path, items_path = Path(tmp) / "users.parquet", Path(tmp) / "items.parquet"
        _write_parquet(users, users_path)
        _write_parquet(items, items_path)
        del users, items
        decode = decode_times(items_path)
        print("decoding the item file alone (best of 3): " + ", ".join(f"{n} {t:.3f} s" for n, t in decode.items()))
        for config in args.env or [""]:
            env = dict(kv.split("=", 1) for kv in config.split(",") if kv)
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            for _ in range(args.repeat):
                out = Path(tmp) / "out.parquet"
                runs.append(run(users_path, items_path, out, w.k) | {"env": env})
                out.unlink()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
            print(f"== {config or 'default'}: walls " + ", ".join(f"{r['wall_s']:.3f}" for r in runs[-args.repeat:]))
            print("\n".join(report(runs[-1]).splitlines()[:2]))
    print(report(runs[-1]))
    args.json.write_text(json.dumps({"workload": args.workload, "decode_s": decode, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
