"""``recall tune``: the fastest tiling of one search shape, found by timing a small grid, and cached for the engine
(``tune="auto"``): the data (generated or read), the trials (``recall.engine.tuning``) and the report."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..bench.workloads import Kind, generate
from ..core.errors import InputError, one_line
from ..engine import Engine, tuning
from ..io import read_embeddings


def fmt_tiles(tiles: Any) -> str:
    return " x ".join(f"{t}" for t in tiles)


def _load_side(path: Path, id_col: str, vec_col: str, what: str) -> Any:
    emb = read_embeddings(path, id_col, vec_col, allow_empty=False)
    if emb.vectors.shape[0] < 1:
        raise InputError(f"{path}: the {what} file has no rows")
    return emb.vectors


def _data(users: int | None, items: int | None, dim: int | None, users_file: Path | None, items_file: Path | None,
          id_col: str, vec_col: str, kind: Kind, seed: int, device: str) -> tuple[Any, Any, str]:
    """(users, items, description): generated on ``device`` (CuPy on the GPU) or read from Parquet (the arguments
    checked first: :func:`_check_arguments`)."""
    user_vecs = _load_side(users_file, id_col, vec_col, "users") if users_file else None
    item_vecs = _load_side(items_file, id_col, vec_col, "items") if items_file else None
    file_dims = {v.shape[1] for v in (user_vecs, item_vecs) if v is not None}
    if len(file_dims) > 1:
        raise InputError(f"--users-file has dimension {user_vecs.shape[1]} but --items-file {item_vecs.shape[1]}")
    if file_dims:
        file_dim = file_dims.pop()
        if dim is not None and dim != file_dim:
            raise InputError(f"--dim {dim} does not match the files' dimension {file_dim}")
        dim = file_dim
    parts = []
    if user_vecs is None or item_vecs is None:
        gen_users, gen_items = generate(kind, users or 1, items or 1, dim, seed=seed, device=device)
        user_vecs = gen_users if user_vecs is None else user_vecs
        item_vecs = gen_items if item_vecs is None else item_vecs
        parts.append(f"{kind.value} data (seed {seed}) generated on the {device}")
    if users_file or items_file:
        parts.append("read from " + " and ".join(str(p) for p in (users_file, items_file) if p))
    return user_vecs, item_vecs, "; ".join(parts)


def _check_arguments(k: int, repeat: int, users: int | None, items: int | None, dim: int | None,
                     users_file: Path | None, items_file: Path | None, seed: int) -> None:
    """The arguments that need no data, refused before anything happens (no notice of the device, no cache folder)."""
    if k < 1:
        raise InputError(f"--k must be >= 1, got {k}")
    if repeat < 1:
        raise InputError(f"--repeat must be >= 1, got {repeat}")
    for flag, n, path in (("--users", users, users_file), ("--items", items, items_file)):
        if (n is None) == (path is None):
            raise InputError(f"give exactly one of {flag} N and {flag}-file PATH")
        if n is not None and n < 1:
            raise InputError(f"{flag} must be >= 1, got {n}")
    if dim is not None and dim < 1:
        raise InputError(f"--dim must be >= 1, got {dim}")
    if dim is None and not (users_file or items_file):  # a file gives the dimension
        raise InputError("--dim is needed to generate data")
    if seed < 0:
        raise InputError(f"--seed must be >= 0, got {seed}")


def report_lines(out: dict[str, Any]) -> list[str]:
    r = out["result"]
    s = out["shape"]
    lines = [f"recall tune: {s['users']:,} users x {s['items']:,} items x {s['dim']}, k={s['k']}, metric "
             f"{out['metric']}, precision {out['precision']}, on {out['device']}",
             f"data: {out['data']} in {out['data_seconds']:.2f} s; engine ready in {out['engine_seconds']:.2f} s; "
             f"memory budget {out['memory_budget']:,} bytes"]
    head = f"  {'candidate (users x width x tiles)':<36}{'plan under the budget':<28}{'median s':>10}" \
           f"{'speed-up':>10}{'warm-up s':>11}"
    lines.append(head)
    base = r["heuristic_seconds"]
    for t in r["trials"]:
        name = fmt_tiles(t["tiles"]) + ("  (heuristic)" if t["heuristic"] else "")
        if tuple(t["tiles"]) == tuple(r["best"]):
            name += "  *best"
        plan = fmt_tiles(t["plan"]) + (f", {t['workers']} workers" if t["workers"] > 1 else "")
        lines.append(f"  {name:<36}{plan:<28}{t['seconds']:>10.4f}{base / t['seconds']:>9.2f}x"
                     f"{t['warmup_seconds']:>11.3f}")
    gain = base - r["best_seconds"]
    lines.append(f"best: {fmt_tiles(r['best'])}: {r['best_seconds']:.4f} s per search vs {base:.4f} s for the "
                 f"heuristic {fmt_tiles(r['heuristic'])}: {base / r['best_seconds']:.2f}x, {gain:.4f} s saved "
                 f"per search")
    for note in r["notes"]:
        lines.append(f"note: {note}")
    payback = f"; pays for itself after {out['break_even_searches']:,} searches of this shape" \
        if out["break_even_searches"] else ""
    lines.append(f"tuning cost: {r['tuning_seconds']:.1f} s of trials ({len(r['trials'])} candidates x (1 warm-up + "
                 f"{r['repeat']} runs); the first, cold search took {r['cold_seconds']:.3f} s), "
                 f"{out['total_seconds']:.1f} s in all{payback}")
    if r["saved_to"]:
        lines.append(f"cached in {r['saved_to']} as {r['key_string']}")
    else:
        lines.append("not cached (--no-save)")
    return lines


def run(k: int, users: int | None, items: int | None, dim: int | None, users_file: Path | None,
        items_file: Path | None, id_col: str, vec_col: str, device: str, metric: str, precision: str, kind: Kind,
        memory_budget: int | None, repeat: int, seed: int, save: bool,
        progress: Any = None) -> dict[str, Any]:
    """Tune one shape; returns the report (what ``--json`` prints).

    Raises
    ------
    InputError
        Bad arguments or data, data of this shape that does not fit in memory, or (with ``save``) no directory for
        the tune cache.
    OSError
        With ``save``: the cache's directory cannot be created, or the cache cannot be written.
    """
    from .. import backends

    started = time.perf_counter()
    _check_arguments(k, repeat, users, items, dim, users_file, items_file, seed)
    # Where the result goes, found before the data and the trials: a cache that cannot be written fails now, not
    # after minutes of timing.
    cache = tuning.cache_path() if save else None
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
    backend = backends.resolve(device)
    t0 = time.perf_counter()
    try:
        user_vecs, item_vecs, described = _data(users, items, dim, users_file, items_file, id_col, vec_col, kind,
                                                seed, backend.name)
    except MemoryError as exc:
        raise InputError(f"not enough memory for the data of this shape ({one_line(exc)}): tune a "
                         f"smaller --users, --items or --dim") from None
    backend.synchronize()
    data_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = Engine(item_vecs, metric=metric, device=backend, memory_budget=memory_budget, precision=precision,
                    tune="off")
    # Users stay where the engine computes (on the GPU: uploaded once, not per search).
    user_vecs = backend.ingest(user_vecs)
    engine_s = time.perf_counter() - t0
    del item_vecs
    result = tuning.tune_engine(engine, user_vecs, k, repeat=repeat, save=save, path=cache, progress=progress)
    total = time.perf_counter() - started
    gain = result.heuristic_seconds - result.best_seconds
    return {"shape": {"users": int(user_vecs.shape[0]), "items": int(engine.n_items), "dim": int(engine.dim),
                      "k": int(k)},
            "metric": metric, "precision": precision, "device": engine.backend.describe(),
            "data": described, "data_seconds": data_s, "engine_seconds": engine_s,
            "memory_budget": int(engine.memory_budget), "total_seconds": total, "gain_seconds": gain,
            "speedup": result.heuristic_seconds / result.best_seconds,
            "break_even_searches": int(-(-result.tuning_seconds // gain)) if gain > 0 else None,
            "result": result.to_dict()}
