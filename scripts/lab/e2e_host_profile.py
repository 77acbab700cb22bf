"""The host side of ``recall score`` on its own: the Parquet pipeline with the search replaced by an instant fake.

``score_files`` reads users on one thread, searches on the calling thread and writes on another; on a GPU the search
of S4 (1M users x 1M items x 64, k=100) takes 4-5.5 s, so everything else must run well above that rate to hide
behind it. This script measures that ceiling without any compute:

1. writes seeded Parquet inputs of the given shape (``id`` int64, ``embedding`` fixed_size_list<float32>[dim]) to a
   temporary directory;
2. runs ``score_files`` on the CPU backend with ``Engine.search`` replaced by a fake that returns precomputed
   results of the right shapes at once (valid item rows, their ids, descending scores), so that what remains is item
   loading, engine construction, reading, result -> Arrow conversion and Parquet writing. With
   ``--simulate-search-s S`` the fake also waits S seconds in all, spread over the batches, the way the calling
   thread waits for a GPU (no GIL, no core): the wall time over S is then the ratio the GPU job would see, if the
   GPU machine's cores were these;
3. runs the real CPU engine end to end on a small shape (``--check-users`` x ``--check-items``) and compares the
   file with ``Engine.search``, so that a faster pipeline is not a wrong one.

Stage times are busy seconds summed over threads (they overlap: the pipeline works when they add up to more than the
wall time); "Parquet write" is the writer thread's time in ``CandidateWriter.write``, waiting for its encoding
threads included. "before first search" is the part nothing can hide (items, engine, first user batch); "after last
search" is what is left when the last batch is searched (its conversion and write, closing the file). Each shape
runs ``--repeat`` times and the last run is printed: on a virtual machine, the first touch of fresh memory costs
seconds that later runs do not pay.

Usage, from the project root::

    PYTHONPATH=. python scripts/e2e_host_profile.py --users 1000000 --items 1000000 --dim 64 --k 100 1000 \
        [--compression snappy none] [--simulate-search-s 4.5] [--batch-size N] [--json PATH]

The JSON (default ``$OUT/e2e_host_profile.json``, else ``./e2e_host_profile.json``) holds every run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import recall
from recall import Engine, SearchResult
from recall.io import CandidateWriter, read_embeddings
from recall.jobs import files as pipeline, items as item_loading
from recall.jobs.runner import Done


def write_inputs(directory: Path, n_users: int, n_items: int, dim: int, seed: int,
                 row_group_size: int | None) -> tuple[Path, Path]:
    """Seeded users and items Parquet files (``id`` int64 in shuffled order, ``embedding`` fixed-size float32)."""
    rng = np.random.default_rng(seed)
    paths = []
    for name, n, base in (("users", n_users, 10_000_000), ("items", n_items, 50_000_000)):
        vecs = rng.standard_normal((n, dim), dtype=np.float32)
        ids = base + rng.permutation(n).astype(np.int64)
        table = pa.table({"id": ids, "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), dim)})
        path = directory / f"{name}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(path)
    return paths[0], paths[1]


class _Timers:
    """Busy seconds per stage, summed over threads, and when the searches began and ended."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.first_search: float | None = None
        self.last_search: float | None = None
        self._lock = threading.Lock()

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[stage] += time.perf_counter() - t0
                    self.calls[stage] += 1
        return timed

    def wrap_iter(self, stage: str, fn: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        """Time a generator function: each ``next`` counts, not the call that creates it."""
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Iterator[Any]:
            it = fn(*args, **kwargs)
            while True:
                t0 = time.perf_counter()
                item = next(it, None)
                with self._lock:
                    self.seconds[stage] += time.perf_counter() - t0
                if item is None:
                    return
                self.calls[stage] += 1
                yield item
        return timed


def _fake_search(timers: _Timers, seconds_per_user: float) -> Callable[..., Done]:
    """An ``Engine.search_async`` that returns slices of one precomputed result: item rows drawn at random (valid), their
    ids as the engine would map them, scores sorted best first. With ``seconds_per_user`` > 0 it first sleeps that
    long per user, as a thread waiting for a GPU would (without the GIL, without a core)."""
    cache: dict[int, SearchResult] = {}

    def search(engine: Engine, user_vecs: np.ndarray, k: int, exclude: Any = None) -> Done:
        t0 = time.perf_counter()
        n = len(user_vecs)
        pre = cache.get(k)
        if pre is None or pre.n_users < n:
            rng = np.random.default_rng(k)
            rows = rng.integers(0, engine.n_items, (n, k), dtype=np.int64)
            scores = np.ascontiguousarray(np.sort(rng.standard_normal((n, k), dtype=np.float32), axis=1)[:, ::-1])
            ids = engine.ids[rows] if engine.ids is not None else rows
            pre = cache[k] = SearchResult(rows, scores, ids)
        if timers.first_search is None:
            timers.first_search = t0
        time.sleep(seconds_per_user * n)
        timers.last_search = time.perf_counter()
        return Done(SearchResult(pre.indices[:n], pre.scores[:n], pre.ids[:n]))

    return search


@contextmanager
def _instrumented(timers: _Timers, search: Callable[..., Done]) -> Iterator[None]:
    """Patch the job's stages with timing wrappers, and ``Engine.search_async`` with ``search``."""
    with ExitStack() as stack:
        patch = functools.partial(mock.patch.object, autospec=False)
        stack.enter_context(patch(item_loading, "read_embeddings", timers.wrap("item load",
                                                                                 item_loading.read_embeddings)))
        stack.enter_context(patch(pipeline, "read_ids", timers.wrap("user ids", pipeline.read_ids)))
        stack.enter_context(patch(Engine, "__init__", timers.wrap("engine construction", Engine.__init__)))
        stack.enter_context(patch(pipeline, "iter_embedding_batches",
                                  timers.wrap_iter("read users", pipeline.iter_embedding_batches)))
        stack.enter_context(patch(Engine, "search_async", timers.wrap("search", search)))
        stack.enter_context(patch(SearchResult, "to_arrow", timers.wrap("result -> Arrow", SearchResult.to_arrow)))
        stack.enter_context(patch(CandidateWriter, "write", timers.wrap("Parquet write", CandidateWriter.write)))
        stack.enter_context(patch(CandidateWriter, "commit", timers.wrap("close + rename", CandidateWriter.commit)))
        yield


STAGES = ("item load", "engine construction", "user ids", "read users", "search", "result -> Arrow",
          "Parquet write", "close + rename")


def run_fake(users: Path, items: Path, out: Path, k: int, batch_size: int | None, search_s: float,
             **options: Any) -> dict[str, Any]:
    """``score_files`` with the fake search (``search_s`` seconds of waiting in all); stage seconds, wall, rates and
    the output's size."""
    timers = _Timers()
    n_users = pq.ParquetFile(users).metadata.num_rows
    with _instrumented(timers, _fake_search(timers, search_s / max(n_users, 1))):
        t0, cpu0 = time.perf_counter(), time.process_time()
        summary = pipeline.score_files(users, items, out, k, device="cpu", batch_size=batch_size, **options)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    pairs = summary.users * min(k, summary.items)
    return {
        "users": summary.users, "items": summary.items, "dim": summary.dim, "k": k,
        "batch_size": summary.batch_size, "options": options, "simulated_search_s": search_s, "wall_s": wall,
        "cpu_s": cpu,
        "stages_s": {s: timers.seconds.get(s, 0.0) for s in STAGES},
        "batches": timers.calls.get("search", 0),
        "before_first_search_s": (timers.first_search or t0) - t0,
        "after_last_search_s": t0 + wall - (timers.last_search or t0),
        "users_per_s": summary.users / wall, "pairs_per_s": pairs / wall,
        "out_bytes": out.stat().st_size,
    }


def run_check(directory: Path, n_users: int, n_items: int, dim: int, k: int, seed: int) -> dict[str, Any]:
    """The real CPU engine end to end on a small shape, its file compared with ``Engine.search``."""
    users, items = write_inputs(directory, n_users, n_items, dim, seed + 1, None)
    out = directory / "check.parquet"
    t0 = time.perf_counter()
    summary = pipeline.score_files(users, items, out, k, device="cpu")
    wall = time.perf_counter() - t0
    u, i = read_embeddings(users), read_embeddings(items)
    expected = recall.Engine(i.vectors, ids=i.ids, device="cpu").search(u.vectors, k).to_arrow(u.ids)
    got = pq.read_table(out)
    same = got.select(expected.column_names).cast(expected.schema).equals(expected)
    return {"users": n_users, "items": n_items, "dim": dim, "k": k, "wall_s": wall, "search_s": summary.search_s,
            "users_per_s": n_users / wall, "matches_engine_search": bool(same)}


def _table(r: dict[str, Any], cores: int) -> str:
    lines = [f"{r['users']:,} users x {r['items']:,} items, dim {r['dim']}, k {r['k']}, batch {r['batch_size']:,} "
             f"({r['batches']} batches), options {r['options'] or 'default'}",
             f"{'stage':<22} {'busy s':>8}"]
    lines += [f"{s:<22} {r['stages_s'][s]:>8.3f}" for s in STAGES]
    lines += [
        f"{'wall':<22} {r['wall_s']:>8.3f}"
        + (f"   ({r['wall_s'] / r['stages_s']['search']:.2f}x the search)" if r["simulated_search_s"] else ""),
        f"{'CPU (all threads)':<22} {r['cpu_s']:>8.3f}",
        f"{'before first search':<22} {r['before_first_search_s']:>8.3f}",
        f"{'after last search':<22} {r['after_last_search_s']:>8.3f}",
        f"users/s {r['users_per_s']:,.0f}   pairs/s {r['pairs_per_s']:,.0f}   pairs per CPU-second "
        f"{r['pairs_per_s'] * r['wall_s'] / r['cpu_s']:,.0f} ({cores} cores)   output {r['out_bytes'] / 2**20:,.1f} MiB",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=200_000)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[100], help="one run per k")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the pipeline's automatic size")
    parser.add_argument("--row-group-size", type=int, default=None, help="of the input files (default: pyarrow's)")
    parser.add_argument("--simulate-search-s", type=float, default=0.0,
                        help="seconds the fake search waits in all, as for a GPU (default 0: instant)")
    parser.add_argument("--compression", nargs="+", default=[None],
                        help="one run per codec (default: the pipeline's)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs per shape, the last one printed (all in the JSON): the first touches fresh memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-users", type=int, default=2_000, help="0: skip the real-engine check")
    parser.add_argument("--check-items", type=int, default=20_000)
    parser.add_argument("--tmp-dir", type=Path, default=None, help="where the inputs go (default: the system's)")
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "e2e_host_profile.json")
    args = parser.parse_args(argv)

    cores = os.cpu_count() or 1
    report: dict[str, Any] = {"host": platform.node(), "cores": cores, "recall": recall.__file__,
                              "pyarrow": pa.__version__, "numpy": np.__version__, "runs": []}
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        directory = Path(tmp)
        t0 = time.perf_counter()
        users, items = write_inputs(directory, args.users, args.items, args.dim, args.seed, args.row_group_size)
        print(f"inputs written in {time.perf_counter() - t0:.1f} s: users {users.stat().st_size / 2**20:,.0f} MiB, "
              f"items {items.stat().st_size / 2**20:,.0f} MiB ({cores} cores)")
        for k in args.k:
            for compression in args.compression:
                options = {"compression": compression} if compression else {}
                for _ in range(args.repeat):
                    out = directory / f"out-k{k}.parquet"
                    run = run_fake(users, items, out, k, args.batch_size, args.simulate_search_s, **options)
                    out.unlink()
                    report["runs"].append(run)
                print(_table(run, cores), end="\n\n")
        if args.check_users:
            check = run_check(directory, args.check_users, args.check_items, args.dim, args.k[0], args.seed)
            report["check"] = check
            print(f"real CPU engine: {check['users']:,} users x {check['items']:,} items, k {check['k']}: "
                  f"{check['wall_s']:.2f} s wall ({check['search_s']:.2f} s search, {check['users_per_s']:,.0f} "
                  f"users/s); file equals Engine.search: {check['matches_engine_search']}")
    args.json.write_text(json.dumps(report, indent=1))
    print(f"-> {args.json}")


if __name__ == "__main__":
    main()
