"""``recall score`` (every user against every item, Parquet to Parquet) and ``recall demo`` (the bundled sample)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from ..core.checks import check_batch_size
from ..core.errors import InputError
from ..jobs import JobOptions, score_files
from .common import (Aggregate, AllowEmptyOption, AllowOption, BatchSizeOption, Compression, DenyOption, Device,
                     DeviceOption, ExcludeOption, IdColOption, ItemMemoryOption, MemoryBudgetOption, Metric, MetricOption, Precision,
                     QuietOption, VecColOption, errors_to_exit, input_file, interruptible, logging_to_stderr,
                     nothing_written, parse_bytes, progress_bar, say_first_run, show_progress)


def _run_score(users: Path, items: Path, out: str, k: int, metric: Metric, exclude: Path | None, id_col: str,
               vec_col: str, device: Device, batch_size: int | None, memory_budget: int | None, quiet: bool,
               verbose: bool, interests: Aggregate | None = None, precision: Precision = Precision.exact,
               compression: Compression = Compression.snappy, allow: Path | None = None,
               deny: Path | None = None, allow_empty: bool = False, item_memory: int | None = None) -> Any:
    if interests is not None and precision is not Precision.exact:
        raise InputError("--precision fast applies to single-vector users; with --interests use --precision exact")
    say_first_run(quiet, device.value)
    with progress_bar(show_progress(quiet)) as progress:
        summary = score_files(users, items, out, k, metric=metric.value, exclude_path=exclude, id_col=id_col,
                              vec_col=vec_col, device=device.value, batch_size=batch_size,
                              memory_budget=memory_budget, progress=progress, precision=precision.value,
                              compression=compression.value, aggregate=interests.value if interests else None,
                              allow_path=allow, deny_path=deny, allow_empty=allow_empty,
                              options=JobOptions(item_memory=item_memory))
    for warning in summary.warnings():
        typer.echo(warning, err=True)
    typer.echo(summary.line())
    if verbose:
        typer.echo(summary.stages_line())
    return summary


def score(
    users: Annotated[Path, input_file("--users", "User embeddings Parquet (id + vector columns).")],
    items: Annotated[Path, input_file("--items", "Item embeddings Parquet (id + vector columns).")],
    k: Annotated[int, typer.Option("--k", help="Items per user (>= 1).", show_default=False)],
    out: Annotated[str, typer.Option("--out", metavar="<path>", help="Candidates Parquet file to write (atomically).",
                                     show_default=False)],
    metric: MetricOption = Metric.ip,
    exclude: ExcludeOption = None,
    allow: AllowOption = None,
    deny: DenyOption = None,
    allow_empty: AllowEmptyOption = False,
    id_col: IdColOption = "id",
    vec_col: VecColOption = "embedding",
    device: DeviceOption = Device.auto,
    batch_size: BatchSizeOption = None,
    memory_budget: MemoryBudgetOption = None,
    item_memory: ItemMemoryOption = None,
    quiet: QuietOption = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also print per-stage times.")] = False,
    precision: Annotated[Precision, typer.Option(
        "--precision", help="exact: float32 scores (on a GPU, large searches find their candidates on tensor "
        "cores and re-score them with the exact kernel's sums: the same bits); fast: the same search, re-scored "
        "in its own order (same answer but for float32 near-ties); on the CPU, exact.")] = Precision.exact,
    interests: Annotated[Aggregate | None, typer.Option(
        "--interests", help="Users have several vectors (ids repeated, or a list of vectors per row): an item's "
        "score is the max or the sum over them.", show_default=False)] = None,
    compression: Annotated[Compression, typer.Option(
        "--compression", help="Parquet codec of the output: snappy; lz4 (about as fast and small); zstd (level 1: "
        "~20% smaller than snappy, ~1.6x its encoding CPU); none (~35% larger, half the encoding CPU)."
    )] = Compression.snappy,
) -> None:
    """Score every user against every item and write each user's top-k items to Parquet."""
    with logging_to_stderr(quiet, verbose), errors_to_exit(), interruptible(nothing_written(out)):
        if batch_size is not None:
            check_batch_size(batch_size, "--batch-size")
        _run_score(users, items, out, k, metric, exclude, id_col, vec_col, device, batch_size,
                   parse_bytes(memory_budget), quiet, verbose, interests, precision, compression, allow, deny,
                   allow_empty, parse_bytes(item_memory, "--item-memory"))


def sample_dir() -> Path:
    """The bundled sample: ``data/`` next to the ``recall`` package in a source checkout."""
    return Path(__file__).resolve().parent.parent.parent / "data"


def _format_top(item_ids: list[Any], scores: list[float], n: int) -> str:
    return ", ".join(f"{i} ({s:.2f})" for i, s in zip(item_ids[:n], scores[:n]))


def demo(
    out: Annotated[str, typer.Option("--out", metavar="<path>", help="Where to write the candidates Parquet.")]
    = "demo-candidates.parquet",
    k: Annotated[int, typer.Option("--k", help="Items per user.")] = 10,
    device: Annotated[Device, typer.Option("--device", help="auto: the GPU when usable, else the CPU.")]
    = Device.auto,
    data: Annotated[Path | None, typer.Option(
        "--data", help="Directory with users/items/exclusions.parquet (default: the bundled sample).",
        show_default=False)] = None,
    n_users: Annotated[int, typer.Option("--show", help="How many users' top-5 to print (at least 1).")] = 3,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no notices.")] = False,
) -> None:
    """Score the bundled sample (3,000 users x 5,000 items, with exclusions) and show a few users' top items."""
    with logging_to_stderr(quiet, False), errors_to_exit():
        if n_users < 1:
            raise InputError(f"--show must be at least 1, got {n_users}")
        data_dir = data if data is not None else sample_dir()
        names = ("users.parquet", "items.parquet", "exclusions.parquet")
        missing = [n for n in names if not (data_dir / n).is_file()]
        if missing:
            raise InputError(f"{data_dir}: the sample files {', '.join(missing)} are missing; run "
                             f"'python scripts/make_sample_data.py --out {data_dir}' from a source checkout, "
                             f"or pass --data DIR")
        with interruptible(nothing_written(out)):
            summary = _run_score(data_dir / names[0], data_dir / names[1], out, k, Metric.ip, data_dir / names[2],
                                 "id", "embedding", device, None, None, quiet, False)
        with interruptible(lambda exc: f"interrupted: {out} is written, complete"):
            _show(out, data_dir / names[2], n_users, k, summary)


def _show(out: str, exclusions: Path, n_users: int, k: int, summary: Any) -> None:
    """The demo's lines: a few users' top 5 from ``out``, one of them a user with exclusions."""
    import pyarrow.parquet as pq

    excluded_users = pq.read_table(exclusions, columns=["user_id"]).column("user_id").to_numpy()
    table = pq.read_table(out)
    rows = list(range(min(n_users, table.num_rows)))
    # Show one user whose already-seen items were excluded, so the demo shows exclusions at work.
    with_excl = np.flatnonzero(np.isin(table.column("user_id").to_numpy(), excluded_users))
    if with_excl.size and not set(rows) & set(with_excl.tolist()) and rows:
        rows[-1] = int(with_excl[0])
    typer.echo(f"top-5 items (score) of {len(rows)} users; {min(k, summary.items):,} per user written to {out}:")
    for row in table.take(rows).to_pylist():
        n_excl = int(np.count_nonzero(excluded_users == row["user_id"]))
        note = f"  [{n_excl} already-seen items excluded]" if n_excl else ""
        typer.echo(f"  user {row['user_id']}: {_format_top(row['item_ids'], row['scores'], 5)}{note}")
    if summary.pairs:
        typer.echo(f"{summary.pairs:,} (user, item) exclusion pairs applied from {exclusions}")
