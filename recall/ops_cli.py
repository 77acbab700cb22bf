"""``recall doctor`` (is this machine's stack sound?) and ``recall tune`` (the best tiling for a shape, cached).

Exit codes. doctor: 0 when every check passes (no GPU in ``--device auto`` is not a failure), 1 when one fails.
tune: 0 on success; 2 for bad arguments or data, an unmet budget, or ``--device gpu`` without a GPU; 1 when the cache
cannot be written.
"""
from __future__ import annotations

import enum
import json
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .bench.workloads import Kind
from .cli import Device, Metric




class Precision(str, enum.Enum):
    exact = "exact"
    fast = "fast"


def doctor(
    device: Annotated[Device, typer.Option(
        help="auto: GPU checks when a GPU is usable, else the CPU's (not a failure); gpu: no GPU fails.")]
    = Device.auto,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON (for machines).")] = False,
) -> None:
    """Check the environment: versions, CUDA, GPUs, GEMM accuracy, exact top-k, bandwidth, FAISS. Exit 1 on a FAIL."""
    from . import doctor as doc
    from .cli import _logging

    with _logging(quiet=as_json, verbose=False):
        report = doc.run(device.value)
    if as_json:
        typer.echo(json.dumps(report, indent=1, default=str))
    else:
        for line in doc.render(report):
            typer.echo(line)
    if not report["ok"]:
        raise typer.Exit(1)


def _fmt_tiles(tiles: Any) -> str:
    return " x ".join(f"{t}" for t in tiles)


def _load_side(path: Path, id_col: str, vec_col: str, what: str) -> Any:
    from .errors import InputError
    from .io import read_embeddings

    emb = read_embeddings(path, id_col, vec_col, allow_empty=False)
    if emb.vectors.shape[0] < 1:
        raise InputError(f"{path}: the {what} file has no rows")
    return emb.vectors


def _data(users: int | None, items: int | None, dim: int | None, users_file: Path | None, items_file: Path | None,
          id_col: str, vec_col: str, kind: Kind, seed: int, device: str) -> tuple[Any, Any, str]:
    """(users, items, description): generated on ``device`` (CuPy on the GPU) or read from Parquet."""
    from .bench.workloads import generate
    from .errors import InputError

    for flag, n, path in (("--users", users, users_file), ("--items", items, items_file)):
        if (n is None) == (path is None):
            raise InputError(f"give exactly one of {flag} N and {flag}-file PATH")
        if n is not None and n < 1:
            raise InputError(f"{flag} must be >= 1, got {n}")
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
    if dim is None:
        raise InputError("--dim is needed to generate data")
    if dim < 1:
        raise InputError(f"--dim must be >= 1, got {dim}")
    parts = []
    if user_vecs is None or item_vecs is None:
        gen_users, gen_items = generate(kind, users or 1, items or 1, dim, seed=seed, device=device)
        user_vecs = gen_users if user_vecs is None else user_vecs
        item_vecs = gen_items if item_vecs is None else item_vecs
        parts.append(f"{kind.value} data (seed {seed}) generated on the {device}")
    if users_file or items_file:
        parts.append("read from " + " and ".join(str(p) for p in (users_file, items_file) if p))
    return user_vecs, item_vecs, "; ".join(parts)


def _report_lines(out: dict[str, Any]) -> list[str]:
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
        name = _fmt_tiles(t["tiles"]) + ("  (heuristic)" if t["heuristic"] else "")
        if tuple(t["tiles"]) == tuple(r["best"]):
            name += "  *best"
        plan = _fmt_tiles(t["plan"]) + (f", {t['workers']} workers" if t["workers"] > 1 else "")
        lines.append(f"  {name:<36}{plan:<28}{t['seconds']:>10.4f}{base / t['seconds']:>9.2f}x"
                     f"{t['warmup_seconds']:>11.3f}")
    gain = base - r["best_seconds"]
    lines.append(f"best: {_fmt_tiles(r['best'])}: {r['best_seconds']:.4f} s per search vs {base:.4f} s for the "
                 f"heuristic {_fmt_tiles(r['heuristic'])}: {base / r['best_seconds']:.2f}x, {gain:.4f} s saved "
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


def tune(
    k: Annotated[int, typer.Option("--k", help="Items per user (>= 1).", show_default=False)],
    users: Annotated[Optional[int], typer.Option("--users", help="Number of users to generate.",
                                                 show_default=False)] = None,
    items: Annotated[Optional[int], typer.Option("--items", help="Number of items to generate.",
                                                 show_default=False)] = None,
    dim: Annotated[Optional[int], typer.Option("--dim", help="Dimension of generated vectors.",
                                               show_default=False)] = None,
    users_file: Annotated[Optional[Path], typer.Option(
        "--users-file", dir_okay=False, help="Users Parquet (id, embedding) instead of --users.")] = None,
    items_file: Annotated[Optional[Path], typer.Option(
        "--items-file", dir_okay=False, help="Items Parquet (id, embedding) instead of --items.")] = None,
    id_col: Annotated[str, typer.Option("--id-col", help="Id column of the Parquet files.")] = "id",
    vec_col: Annotated[str, typer.Option("--vec-col", help="Vector column of the Parquet files.")] = "embedding",
    device: Annotated[Device, typer.Option("--device", help="auto: the GPU when usable, else the CPU.")]
    = Device.auto,
    metric: Annotated[Metric, typer.Option("--metric", help="ip: inner product; cosine; l2.")] = Metric.ip,
    precision: Annotated[Precision, typer.Option("--precision", help="The engine's precision mode.")]
    = Precision.exact,
    kind: Annotated[Kind, typer.Option("--kind", help="Kind of generated data (as recall bench).")]
    = Kind.clustered,
    budget: Annotated[Optional[str], typer.Option(
        "--budget", "--memory-budget", metavar="BYTES",
        help="The engine's working memory, e.g. 2G (default: the engine's).", show_default=False)] = None,
    repeat: Annotated[int, typer.Option("--repeat", help="Timed searches per candidate, after a warm-up; the median "
                                        "counts.")] = 3,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the generated data.")] = 0,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Store the best tiling in the tune cache.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress lines on stderr.")] = False,
) -> None:
    """Time a small grid of tilings for one search shape and cache the fastest for the engine (tune="auto")."""
    from . import backends, metrics, tune as tuning
    from .cli import _errors_to_exit, _logging, parse_bytes
    from .engine import Engine
    from .errors import InputError

    started = time.perf_counter()
    with _logging(quiet, False), _errors_to_exit():
        if k < 1:
            raise InputError(f"--k must be >= 1, got {k}")
        if repeat < 1:
            raise InputError(f"--repeat must be >= 1, got {repeat}")
        try:
            memory_budget = parse_bytes(budget)
        except InputError as exc:
            raise InputError(str(exc).replace("--memory-budget", "--budget")) from None
        backend = backends.resolve(device.value)
        t0 = time.perf_counter()
        user_vecs, item_vecs, described = _data(users, items, dim, users_file, items_file, id_col, vec_col, kind,
                                                seed, backend.name)
        if backend.name == "gpu":
            backend.synchronize()
            backend.xp.cuda.Device().synchronize()
        data_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine = Engine(item_vecs, metric=metric.value, device=backend.name, memory_budget=memory_budget,
                        precision=precision.value, tune="off")
        # Users stay where the engine computes (on the GPU: uploaded once, not per search), prepared once.
        xp = engine.backend.xp
        prepared = metrics.prepare_users(metric.value, xp, engine.backend.asarray(user_vecs))
        engine_s = time.perf_counter() - t0
        del item_vecs

        def progress(trial: Any, i: int, n: int) -> None:
            if not quiet:
                typer.echo(f"[{i + 1}/{n}] {_fmt_tiles(trial.tiles)}: {trial.seconds:.4f} s "
                           f"(warm-up {trial.warmup_seconds:.3f} s)", err=True)

        result = tuning.tune_engine(engine, prepared, k, repeat=repeat, save=save, progress=progress)
    total = time.perf_counter() - started
    gain = result.heuristic_seconds - result.best_seconds
    out = {"shape": {"users": int(prepared.shape[0]), "items": int(engine.n_items), "dim": int(engine.dim),
                     "k": int(k)},
           "metric": metric.value, "precision": precision.value, "device": engine.backend.describe(),
           "data": described, "data_seconds": data_s, "engine_seconds": engine_s,
           "memory_budget": int(engine.memory_budget), "total_seconds": total, "gain_seconds": gain,
           "speedup": result.heuristic_seconds / result.best_seconds,
           "break_even_searches": int(-(-result.tuning_seconds // gain)) if gain > 0 else None,
           "result": result.to_dict()}
    if as_json:
        typer.echo(json.dumps(out, indent=1, default=str))
    else:
        for line in _report_lines(out):
            typer.echo(line)


def register(app: typer.Typer) -> None:
    """Add ``doctor`` and ``tune`` to the main ``recall`` CLI app."""
    app.command("doctor")(doctor)
    app.command("tune")(tune)
