"""``recall rescore``: each user's own candidate list, re-scored, top k kept (``Engine.rescore``).

Exit codes as for ``recall score``: 0 done; 2 bad input or arguments (one ``error:`` line naming the file, row and
id); 1 an operating-system failure (naming the path); 143 / 130 on SIGTERM / SIGINT (nothing written). Unknown user
or item ids in the candidates file are skipped and counted in one ``warning:`` line on stderr.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..core.checks import check_batch_size
from ..jobs import JobOptions, rescore_files
from .common import (AllowOption, BatchSizeOption, DenyOption, Device, DeviceOption, IdColOption, ItemMemoryOption, MemoryBudgetOption,
                     Metric, MetricOption, VecColOption, errors_to_exit, input_file, interruptible, logging_to_stderr,
                     nothing_written, parse_bytes, say_first_run)


def rescore(
    users: Annotated[Path, input_file("--users", "User embeddings Parquet (id + vector columns).")],
    items: Annotated[Path, input_file("--items", "Item embeddings Parquet (id + vector columns).")],
    candidates: Annotated[Path, input_file(
        "--candidates", "Parquet of user_id, item_ids (a list per row; or user_id, item_id pairs).")],
    k: Annotated[int, typer.Option("--k", help="Items kept per user (>= 1).", show_default=False)],
    out: Annotated[str, typer.Option("--out", metavar="<path>", help="Candidates Parquet file to write (atomically).",
                                     show_default=False)],
    metric: MetricOption = Metric.ip,
    allow_empty: Annotated[bool, typer.Option(
        "--allow-empty", help="Write an empty output when the users or the candidates file has no rows (default: "
                              "refuse, exit 2, and leave the previous output as it was).")] = False,
    id_col: IdColOption = "id",
    vec_col: VecColOption = "embedding",
    device: DeviceOption = Device.auto,
    batch_size: BatchSizeOption = None,
    memory_budget: MemoryBudgetOption = None,
    item_memory: ItemMemoryOption = None,
    allow: AllowOption = None,
    deny: DenyOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No notices.")] = False,
) -> None:
    """Score each user against its own candidate items only and write its top-k to Parquet.

    One output row per user named in the candidates file, in the users file's order; a user's duplicates count once;
    unknown user or item ids are skipped with a warning that counts them.
    """
    with logging_to_stderr(quiet, False), errors_to_exit(), interruptible(nothing_written(out)):
        if batch_size is not None:
            check_batch_size(batch_size, "--batch-size")
        say_first_run(quiet, device.value)
        summary = rescore_files(users, items, candidates, out, k, metric=metric.value, id_col=id_col,
                                vec_col=vec_col, device=device.value, memory_budget=parse_bytes(memory_budget),
                                batch_size=batch_size, allow_path=allow, deny_path=deny, allow_empty=allow_empty,
                                options=JobOptions(item_memory=parse_bytes(item_memory, "--item-memory")))
        for warning in summary.warnings():
            typer.echo(warning, err=True)
        typer.echo(summary.line())

