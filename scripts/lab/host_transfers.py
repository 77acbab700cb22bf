"""Lab (GPU): what moving a search's host users to the device and its results back costs, by each way of doing it.

A search of host users (``recall score``, a job's batches, an embedded caller's NumPy arrays) pays for the upload of
its users and the download of its results; the certified route moves them whole, the float32 search block by block
through pinned slots. This times, for ``--users`` x ``--dim`` float32 users and ``--k`` results a user (float32
scores, int64 rows), the median of ``--repeat`` runs of:

  upload    pageable   ``cupy.asarray`` of the NumPy array (the driver's own staging)
            pinned     one copy into a pinned buffer, then one asynchronous upload
            chunks-T   chunks of ``--chunk`` bytes copied into pinned slots by T host threads, each uploaded on a
                       stream as soon as it is there (the host's copies overlap the uploads)
  download  pageable   ``.get()`` of the device arrays into new NumPy arrays
            pinned     asynchronous copies into pinned NumPy arrays (pool-allocated)
            shipped    ``backends.cupy.transfers.HostTransfers`` (a ring of pinned chunks filled by host threads)
  download  shipped    the same, emptied by host threads into a new NumPy array
  staging   blocks     ``host_threads.copy_rows`` of the users into a pinned slot block by block (the float32 search's
                       staging, blocks of ``--block`` rows), and one thread's copy of the same
  host      isfinite   ``np.isfinite(users).all()``: what a validation pass over the users costs the host
            norms      ``metrics.row_norms`` (host threads), and one thread's

    PYTHONPATH=. python3 scripts/lab/host_transfers.py --users 1000000 --dim 64 --k 10 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def median_time(fn, repeat: int) -> float:
    import cupy

    fn()
    times = []
    for _ in range(repeat):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chunked_upload(host: np.ndarray, dev, pinned: list, pool: ThreadPoolExecutor | None, stream, chunk_rows: int):
    """Copy ``host`` into ``dev`` through the pinned slots: slot i % len(pinned) holds chunk i; a slot is refilled
    once its last upload is done (its event)."""
    import cupy

    n = host.shape[0]
    events = [None] * len(pinned)
    starts = list(range(0, n, chunk_rows))

    def fill(i: int) -> int:
        s = starts[i]
        e = min(n, s + chunk_rows)
        slot = i % len(pinned)
        np.copyto(pinned[slot][: e - s], host[s:e])
        return i

    ahead = len(pinned)
    futures = {}
    for i in range(min(ahead, len(starts))):
        futures[i] = pool.submit(fill, i) if pool else None
    for i, s in enumerate(starts):
        e = min(n, s + chunk_rows)
        slot = i % len(pinned)
        if pool:
            futures.pop(i).result()
        else:
            if events[slot] is not None:
                events[slot].synchronize()
            fill(i)
        dev[s:e].set(pinned[slot][: e - s], stream=stream)
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        events[slot] = ev
        nxt = i + ahead
        if pool and nxt < len(starts):
            events[slot].synchronize()  # the slot is free once its upload is done
            futures[nxt] = pool.submit(fill, nxt)
    stream.synchronize()


def main() -> None:
    import cupy
    import cupyx

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--chunk", type=int, default=8 << 20)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--block", type=int, default=32_768)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()

    rng = np.random.default_rng(0)
    host = rng.standard_normal((a.users, a.dim), dtype=np.float32)
    dev = cupy.empty_like(cupy.asarray(host[:1])).repeat(a.users, axis=0)
    rows_out = {}
    stream = cupy.cuda.Stream(non_blocking=True)
    chunk_rows = max(1, a.chunk // (a.dim * 4))

    def row(kind, name, secs, nbytes):
        gbs = nbytes / secs / 1e9
        rows_out[f"{kind} {name}"] = {"s": secs, "GB/s": gbs}
        print(f"| {kind} | {name} | {secs * 1e3:.2f} ms | {gbs:.1f} GB/s |", flush=True)

    print(f"{a.users:,} users x {a.dim} ({host.nbytes / 1e6:.0f} MB), results {a.users:,} x {a.k}")
    print("| what | how | median | rate |\n| --- | --- | ---: | ---: |")
    row("upload", "pageable", median_time(lambda: cupy.asarray(host), a.repeat), host.nbytes)
    whole = cupyx.empty_pinned(host.shape, np.float32)

    def pinned_once():
        np.copyto(whole, host)
        dev.set(whole, stream=stream)
        stream.synchronize()

    row("upload", "pinned", median_time(pinned_once, a.repeat), host.nbytes)
    for threads in (0, 2, 4, 8):
        slots = [cupyx.empty_pinned((chunk_rows, a.dim), np.float32) for _ in range(max(2, threads * 2))]
        pool = ThreadPoolExecutor(threads) if threads else None
        row("upload", f"chunks-{threads} ({a.chunk >> 20} MiB)",
            median_time(lambda: chunked_upload(host, dev, slots, pool, stream, chunk_rows), a.repeat), host.nbytes)
        assert bool((dev[-3:].get() == host[-3:]).all()) and bool((dev[:3].get() == host[:3]).all())
        if pool:
            pool.shutdown()

    vals = cupy.asarray(rng.standard_normal((a.users, a.k), dtype=np.float32))
    rows = cupy.asarray(rng.integers(0, 1 << 40, size=(a.users, a.k)))
    out_bytes = vals.nbytes + rows.nbytes
    row("download", "pageable", median_time(lambda: (vals.get(), rows.get()), a.repeat), out_bytes)

    def pinned_down():
        hv = cupyx.empty_pinned(vals.shape, np.float32)
        hr = cupyx.empty_pinned(rows.shape, np.int64)
        vals.get(stream=stream, out=hv)
        rows.get(stream=stream, out=hr)
        stream.synchronize()

    row("download", "pinned (pool)", median_time(pinned_down, a.repeat), out_bytes)
    from recall.backends.cupy.transfers import HostTransfers
    from recall.core import host_threads, metrics

    moves = HostTransfers()
    row("upload", "shipped", median_time(lambda: moves.upload(host, np.float32), a.repeat), host.nbytes)
    assert bool((moves.upload(host, np.float32)[-5:].get() == host[-5:]).all())
    after = cupy.cuda.Stream(non_blocking=True)
    row("download", "shipped", median_time(lambda: (moves.download(vals, after), moves.download(rows, after)),
                                           a.repeat), out_bytes)
    assert bool((moves.download(rows, after) == rows.get()).all())
    slot = cupyx.empty_pinned((a.block, a.dim), np.float32)

    def staged(copy):
        for s in range(0, a.users, a.block):
            e = min(a.users, s + a.block)
            copy(slot[: e - s], host[s:e])

    shipped_part = host_threads.MIN_PART_BYTES
    for part in (shipped_part, 1 << 20, 1 << 19):
        host_threads.MIN_PART_BYTES = part
        row("staging", f"blocks of {a.block:,} (host threads, parts of {part >> 10} KiB at least)",
            median_time(lambda: staged(host_threads.copy_rows), a.repeat), host.nbytes)
    host_threads.MIN_PART_BYTES = shipped_part
    row("staging", f"blocks of {a.block:,} (one thread)", median_time(lambda: staged(np.copyto), a.repeat),
        host.nbytes)
    row("host", "isfinite", median_time(lambda: bool(np.isfinite(host).all()), a.repeat), host.nbytes)
    row("host", "norms (host threads)", median_time(lambda: metrics.row_norms(np, host), a.repeat), host.nbytes)
    real = host_threads.threads
    host_threads.threads = lambda: 1
    row("host", "norms (one thread)", median_time(lambda: metrics.row_norms(np, host), a.repeat), host.nbytes)
    host_threads.threads = real
    if a.json:
        a.json.write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
