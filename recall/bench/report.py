"""Reports of a benchmark run: a table on the terminal, results.json (every raw number), results.md, PNG plots.

A matrix run (``--matrix``) adds its summary table (one row per cell: recall exact, recall fast, FAISS, cuVS, torch,
the best exact anchor and recall's ratio to it, the check) to the terminal and results.md, and a heat-map of recall
exact's time over each anchor's, per cell (matrix.png).
"""
from __future__ import annotations

import errno
import json
import math
from pathlib import Path
from typing import Any

JSON_NAME = "results.json"
PARTIAL_NAME = "results.partial.json"
MD_NAME = "results.md"
PNG_NAME = "throughput.png"
HEATMAP_NAME = "matrix.png"

COLUMNS = ("workload", "kind", "metric", "device", "contender", "median s", "users/s", "TFLOP/s", "recall@k",
           "vs FAISS", "note")
_TEXT_COLUMNS = ("workload", "kind", "metric", "device", "contender", "note")
MATRIX_COLUMNS = ("#", "cell", "recall exact s", "recall fast s", "FAISS s", "cuVS s", "torch s", "best anchor",
                  "recall / anchor", "speed-up", "recall@k")
_MATRIX_TEXT = ("#", "cell", "best anchor", "recall@k")


def _num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if x == 0:
        return "0"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _recall(row: dict[str, Any]) -> str:
    c = row.get("check")
    if not c:
        return "-"
    text = f"{c['recall']:.4f}"
    if row["claims_exact"] and not c["exact"]:
        text += " WRONG"
    return text


def _note(row: dict[str, Any], repeats: bool) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['reason']}"
    notes = []
    within = (row.get("check") or {}).get("users_within_rounding")
    if within:
        notes.append(f"{within} sampled users' top k within float32's rounding: recall cannot be checked for them")
    if row.get("excl_per_user"):
        notes.append(f"{row['excl_per_user']} exclusions per user")
        if row.get("check") and row["check"].get("excluded_returned"):
            notes.append(f"{row['check']['excluded_returned']} excluded items returned")
    if row["mode"] == "e2e":
        notes.append(f"Parquet to Parquet ({row.get('layout', 'pyarrow')} layout)")
        if row.get("vs_resident"):
            notes.append(f"{row['vs_resident']:.2f}x the resident search")
        st = row.get("stages")
        if st:
            early = f" ({st['early_users']:,} users searched meanwhile)" if st.get("early_users") else ""
            notes.append(f"start-up {st.get('start_s', 0.0):.2f} s{early}; stages (overlapping) read "
                         f"{st['read_s']:.2f}, search {st['search_s']:.2f}, write "
                         f"{st['write_s']:.2f} s, GPU busy {st['device_busy_s']:.2f} s")
    if not row["claims_exact"]:
        notes.append("not exact by design")
    stats = row.get("engine_stats") or {}
    if "busy_fraction" in stats:
        notes.append(f"GPU busy {stats['busy_fraction']:.0%}")
    if stats.get("widened_users"):
        notes.append(f"widened certificate for {stats['widened_users']:,} users")
    if stats.get("fallback_users"):
        notes.append(f"exact fallback for {stats['fallback_users']:,} users")
    if stats.get("fast_declined"):
        why = (f"a sample of {stats['fast_sample']:,} users" if stats.get("fast_sample")
               else stats["fast_declined"])
        notes.append(f"fast mode declined ({why}): ran exact")
    if stats.get("route") == "certified":
        notes.append("certified route (float16 candidates, the fused kernel's sums)")
    elif stats.get("certified_declined"):
        notes.append(f"certified route declined ({stats['certified_declined']})")
    if repeats and len(row["times_s"]) > 1:
        extra = row.get("extra_runs") or 0
        notes.append("runs " + ", ".join(f"{t:.3g}" for t in row["times_s"]) + " s"
                     + (f" ({extra} more: unsteady)" if extra else ""))
        gc_s = row.get("gc_s") or []
        if gc_s and max(gc_s) >= 0.005:  # only pauses that show at the table's precision
            notes.append("garbage collector " + ", ".join(f"{t:.3g}" for t in gc_s) + " s")
    return "; ".join(notes)


def rows_as_text(doc: dict[str, Any], repeats: bool = True) -> list[list[str]]:
    """One list of cell texts per result row, in ``COLUMNS`` order; ``repeats`` lists every timed run in the note."""
    out = []
    for r in doc["results"]:
        name = _label(r)
        out.append([r["workload"], r["kind"], r.get("metric") or doc["settings"]["metric"], r["device"], name,
                    _num(r["median_s"], 4), _num(r["users_per_s"]), _num(r["tflops"]), _recall(r),
                    _num(r["vs_faiss"]) + ("x" if r["vs_faiss"] else ""), _note(r, repeats)])
    return out


def _label(r: dict[str, Any]) -> str:
    """Contender name of a row; end-to-end rows say so, with their layout when it is not the default."""
    if r["mode"] != "e2e":
        return r["contender"]
    layout = r.get("layout", "pyarrow")
    return r["contender"] + (" (e2e)" if layout == "pyarrow" else f" (e2e {layout})")


def floor_lines(doc: dict[str, Any]) -> list[str]:
    """One line per workload with its GEMM and HBM floors (GPU runs with known ceilings)."""
    lines = []
    for w in doc["workloads"]:
        f = w.get("floors")
        if not f:
            continue
        lines.append(f"{w['name']}: floors: GEMM at FP32 {_num(f['gemm_fp32_s'], 3)} s, at BF16 "
                     f"{_num(f['gemm_bf16_s'], 3)} s; every score through HBM once (8 B) {_num(f['hbm_scores_s'], 3)} s")
    if lines and doc.get("ceilings"):
        c = doc["ceilings"]
        lines.append(f"ceilings: FP32 {_num(c.get('fp32_tflops'))} TFLOP/s, TF32 {_num(c.get('tf32_tflops'))}, BF16 "
                     f"{_num(c.get('bf16_tflops'))}, copy {_num(c.get('copy_tbps'))} TB/s ({c.get('source')})")
    return lines


def environment_line(doc: dict[str, Any]) -> str:
    e = doc["environment"]
    parts = [e["date"], f"CPU {e['cpu']} ({e['cpu_count']} cores, load {_load(e)})", f"numpy {e['numpy']}"]
    if e.get("blas"):
        parts.append(e["blas"])
    if e.get("faiss"):
        parts.append(f"faiss {e['faiss']}")
    if e.get("gpu"):
        parts.append(f"GPU {e['gpu']} (driver {e.get('driver')}, CUDA runtime {e.get('cuda_runtime')})")
    if e.get("cupy"):
        parts.append(f"cupy {e['cupy']}")
    if e.get("torch"):
        parts.append(f"torch {e['torch']}")
    if e.get("git_commit") or e.get("recall_sources"):
        sources = f"sources {e['recall_sources']}" if e.get("recall_sources") else None
        parts.append("recall " + ", ".join(p for p in (e.get("git_commit"), sources) if p))
    return "; ".join(parts)


def _load(e: dict[str, Any]) -> str:
    return "?" if not e.get("loadavg") else f"{e['loadavg'][0]:.2f}"


def make_console() -> Any:
    """A rich console for progress and tables: 160 columns when writing to a log or pipe instead of a terminal."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal and console.width < 160:
        # Logs and pipes get rich's 80-column default, which folds every cell; a log line may be long.
        console = Console(width=160)

    def broken_pipe() -> None:
        # rich exits with 1 where stdout's reader has gone (`| head`); the command exits as every command does then
        # (recall.core.errors.stdout_closed: 141, no line), after saying what it left.
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    console.on_broken_pipe = broken_pipe
    return console


def print_table(doc: dict[str, Any], console: Any = None) -> None:
    """The results as a rich table, then the floors and the environment."""
    from rich.table import Table

    console = console or make_console()
    table = Table(title="recall bench", show_lines=False)
    if doc.get("matrix"):
        print_matrix(doc, console)
    else:
        for col in COLUMNS:
            table.add_column(col, justify="left" if col in _TEXT_COLUMNS else "right", overflow="fold")
        for cells in rows_as_text(doc, repeats=False):
            table.add_row(*cells)
        console.print(table)
    for line in floor_lines(doc):
        console.print(line)
    console.print(environment_line(doc), style="dim")


def markdown(doc: dict[str, Any]) -> str:
    """A Markdown table of the results, with the command, environment and floors, ready for docs/benchmarks.md."""
    lines = []
    if doc.get("command"):
        lines.append("Command: `" + " ".join(doc["command"]) + "`")
        lines.append("")
    lines.append("Environment: " + environment_line(doc))
    lines.append("")
    if doc.get("matrix"):
        lines += matrix_markdown(doc)
        lines.append("")
        lines.append("### Every row")
        lines.append("")
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("| " + " | ".join("---" if c in _TEXT_COLUMNS else "---:" for c in COLUMNS) + " |")
    for cells in rows_as_text(doc):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    floors = floor_lines(doc)
    if floors:
        lines.append("")
        lines += [f"- {f}" for f in floors]
    s = doc["settings"]
    lines.append("")
    checked = sorted({r["check"]["n_sample"] for r in doc.get("results", []) if r.get("check")})
    users = (f"{checked[0]:,}" if len(checked) == 1 else f"{checked[0]:,} to {checked[-1]:,}") if checked else \
        f"up to {s['sample_users']:,}"
    lines.append(f"Median of {s['repeat']} timed runs after one warm-up; recall@k against a float64 oracle on "
                 f"{users} sampled users (tie-aware, rtol {s['rtol']:g}); seed {s['seed']}.")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> str:
    """Write a bar chart of users/s per contender per workload to ``path``; returns what happened, in words."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib not installed"
    ok = [r for r in doc["results"] if r["status"] == "ok" and r["users_per_s"]]
    if not ok:
        return "skipped: no timed results to plot"
    workloads = list(dict.fromkeys(f"{r['workload']}\n{r['kind']}" for r in ok))
    names = list(dict.fromkeys(_label(r) for r in ok))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.5))
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            for r in ok:
                if f"{r['workload']}\n{r['kind']}" == w and _label(r) == name:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(r["users_per_s"])
        ax.bar(xs, ys, width=width, label=name)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_yscale("log")
    ax.set_ylabel("users / s (higher is better)")
    device = doc["settings"]["device"]
    where = doc["environment"].get("gpu") if device == "gpu" else doc["environment"].get("cpu")
    ax.set_title(f"recall bench, {device}: {where}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if hasattr(x, "item") and callable(x.item):  # NumPy scalars
        return _jsonable(x.item())
    return x


def write_partial(doc: dict[str, Any], path: Path) -> None:
    """The results so far, as results.json would hold them, written atomically (replaced after each workload)."""
    from recall.io.atomic import write_bytes

    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, (json.dumps(_jsonable(doc), indent=2) + "\n").encode())


def write(doc: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Write results.json, results.md and throughput.png into ``out_dir`` (created); returns {file: status}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    status = {}
    doc["plot"] = plot(doc, out_dir / PNG_NAME)
    status[PNG_NAME] = doc["plot"]
    heatmap_status = "skipped: not a matrix run"
    if doc.get("matrix"):
        heatmap_status = doc["matrix"]["heatmap"] = heatmap(doc, out_dir / HEATMAP_NAME)
        status[HEATMAP_NAME] = heatmap_status
    # A picture this run did not draw is an earlier run's: beside this run's results it would pass for them.
    for name, what in ((PNG_NAME, doc["plot"]), (HEATMAP_NAME, heatmap_status)):
        if not what.startswith("wrote"):
            (out_dir / name).unlink(missing_ok=True)
    # Both files to temporary ones first, then both renamed into place: a full disk leaves neither half-written, nor
    # one of this run beside the other of an earlier one.
    from recall.io import atomic

    texts = {JSON_NAME: json.dumps(_jsonable(doc), indent=2) + "\n", MD_NAME: markdown(doc)}
    temps = {name: atomic.temporary_path(out_dir / name) for name in texts}
    try:
        for name, text in texts.items():
            try:
                temps[name].write_text(text)
            except OSError as exc:
                raise atomic.with_path(exc, out_dir / name, "cannot write") from exc
        for name in texts:
            atomic.replace(temps[name], out_dir / name)
            status[name] = f"wrote {out_dir / name}"
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    return status


# --- matrix runs -----------------------------------------------------------------------------------------------------


def _short_reason(reason: str | None, width: int = 34) -> str:
    text = (reason or "").strip()
    return text if len(text) <= width else text[:width - 1] + "…"


def _entry_text(e: dict[str, Any], extra: str = "") -> str:
    """A contender's table cell: its median seconds (flagged when its answer was wrong), or why there is none."""
    if e.get("median_s"):
        text = _num(e["median_s"], 3) + extra
        if e.get("exact") is False:
            text += " WRONG"
        return text
    if e.get("status") == "absent":
        return "-"
    return "skip" if e.get("status") == "skipped" else str(e.get("status"))


def matrix_rows_as_text(doc: dict[str, Any]) -> list[list[str]]:
    """One list of cell texts per matrix cell, in ``MATRIX_COLUMNS`` order."""
    out = []
    for i, m in enumerate(doc["matrix"]["summary"]):
        if m["status"] != "ok":
            out.append([str(i), m["cell"], *([f"{m['status']}: {_short_reason(m['reason'])}"] + [""] * 7), "-"])
            continue
        fast = m["recall_fast"]
        fallback = fast.get("fallback_users")
        fast_text = _entry_text(fast, f" ({fallback:,} fb)" if fallback else "")
        faiss = m["faiss"]
        faiss_text = _entry_text(faiss, " knn" if faiss.get("contender") == "faiss-knn" else "")
        ratio = _num(m["ratio"], 3) if m["ratio"] else "-"
        speed = (_num(m["speedup"], 3) + "x") if m["speedup"] else "-"
        out.append([str(i), m["cell"], _entry_text(m["recall"]), fast_text, faiss_text, _entry_text(m["cuvs"]),
                    _entry_text(m["torch"]), m["anchor"] or "-", ratio, speed, m["check"]])
    return out


def matrix_reasons(doc: dict[str, Any]) -> list[str]:
    """One line per (contender, reason) of the matrix's "skip" and "error" cells, with the cells it applies to."""
    seen: dict[tuple[str, str, str], list[int]] = {}
    for i, m in enumerate(doc["matrix"]["summary"]):
        for key in ("recall", "recall_fast", "faiss", "cuvs", "torch"):
            e = m[key]
            if e.get("status") in ("skipped", "error") and e.get("reason"):
                name = e.get("contender") or key.replace("_", "-")
                seen.setdefault((e["status"], name, e["reason"]), []).append(i)
    return [f"{status} {name} in cells {_cell_list(cells)}: {reason}"
            for (status, name, reason), cells in seen.items()]


def _cell_list(cells: list[int]) -> str:
    return ", ".join(map(str, cells)) if len(cells) <= 8 else f"{', '.join(map(str, cells[:8]))}, ... ({len(cells)})"


def print_matrix(doc: dict[str, Any], console: Any) -> None:
    """The matrix summary as a rich table."""
    from rich.table import Table

    mx = doc["matrix"]
    table = Table(title=f"recall bench --matrix {mx['grid']} (median seconds; recall / anchor < 1: recall faster)")
    for col in MATRIX_COLUMNS:
        table.add_column(col, justify="left" if col in _MATRIX_TEXT else "right", overflow="fold")
    for cells in matrix_rows_as_text(doc):
        table.add_row(*cells)
    console.print(table)
    for line in matrix_reasons(doc):
        console.print(line, highlight=False)


def matrix_markdown(doc: dict[str, Any]) -> list[str]:
    """Lines of the matrix section of results.md: its table, then how to read it."""
    mx = doc["matrix"]
    lines = [f"## Matrix `{mx['grid']}` ({len(mx['summary'])} cells)", ""]
    lines.append("| " + " | ".join(MATRIX_COLUMNS) + " |")
    lines.append("| " + " | ".join("---" if c in _MATRIX_TEXT else "---:" for c in MATRIX_COLUMNS) + " |")
    for cells in matrix_rows_as_text(doc):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines.append("")
    lines += [f"- {line}" for line in matrix_reasons(doc)]
    lines.append("")
    faiss = ("the faster of GpuIndexFlat and knn_gpu (\"knn\")" if doc["settings"]["device"] == "gpu"
             else "IndexFlat on the CPU")
    lines.append(f"Median seconds of the timed searches. FAISS: {faiss}. "
                 "Best anchor: the fastest of FAISS, cuVS and torch fp32 whose answer was exact; recall / anchor "
                 "below 1 means recall is faster (speed-up = anchor / recall). \"fb\": users for which fast mode fell "
                 "back to the exact search. " + (f"Estimated {mx['estimate_s']:.0f} s, took "
                                                  f"{doc.get('elapsed_s', 0.0):.0f} s." if mx.get("estimate_s")
                                                  else ""))
    return lines


def heatmap(doc: dict[str, Any], path: Path) -> str:
    """Write the heat-map of recall exact's time over each exact anchor's (FAISS, cuVS, torch, best) per cell.

    Rows are cells, columns anchors; colour is log(ratio) on a diverging scale centred at 1 (green: recall faster,
    red: recall slower, and framed); grey: no number (skipped, wrong or failed). Returns what happened, in words."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        from matplotlib.colors import TwoSlopeNorm
        from matplotlib.patches import Rectangle
    except ImportError:
        return "skipped: matplotlib not installed"
    summary = doc["matrix"]["summary"]
    if not summary:
        return "skipped: no cells"
    cols = [("FAISS", lambda m: m["vs"].get("faiss")), ("cuVS", lambda m: m["vs"].get("cuvs")),
            ("torch", lambda m: m["vs"].get("torch")), ("best", lambda m: m["ratio"])]
    vals = np.array([[f(m) if f(m) else np.nan for _, f in cols] for m in summary], dtype=float)
    if not np.isfinite(vals).any():
        return "skipped: no cell has both recall and an exact anchor timed"
    logs = np.log10(vals)
    span = max(float(np.nanmax(np.abs(logs))), 0.05)
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.32 * len(summary)))
    # Greens where recall is faster (darker: faster), reds where it is slower, starting at a clear red so that even a
    # ratio of 1.01 does not read as "about even" the way a yellow middle would.
    from matplotlib.colors import ListedColormap

    greens = plt.get_cmap("Greens_r")(np.linspace(0.0, 0.85, 128))
    reds = plt.get_cmap("Reds")(np.linspace(0.35, 1.0, 128))
    cmap = ListedColormap(np.vstack([greens, reds]), name="recall_vs_anchor")
    cmap = cmap.with_extremes(bad="#d0d0d0") if hasattr(cmap, "with_extremes") else cmap
    if not hasattr(cmap, "with_extremes"):
        cmap.set_bad("#d0d0d0")
    ax.imshow(np.ma.masked_invalid(logs), cmap=cmap, norm=TwoSlopeNorm(vcenter=0.0, vmin=-span, vmax=span),
              aspect="auto")
    for i in range(vals.shape[0]):
        for j in range(vals.shape[1]):
            v = vals[i, j]
            if not np.isfinite(v):
                ax.text(j, i, "-", ha="center", va="center", fontsize=7, color="#555555")
                continue
            slower = v > 1.0
            dark = abs(logs[i, j]) > 0.6 * span
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    fontweight="bold" if slower else "normal", color="white" if dark else "black")
            if slower:  # recall slower than this anchor: framed, beside the red, so it reads in grey print too
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#8b0000", linewidth=1.5))
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([c for c, _ in cols], fontsize=8)
    ax.set_yticks(range(len(summary)))
    ax.set_yticklabels([f"{i}: {m['cell']}" for i, m in enumerate(summary)], fontsize=7)
    ax.xaxis.tick_top()
    device = doc["settings"]["device"]
    where = doc["environment"].get("gpu") if device == "gpu" else doc["environment"].get("cpu")
    ax.set_title(f"recall exact time / anchor time (lower is better; framed: recall slower)\n"
                 f"--matrix {doc['matrix']['grid']}, {device}: {where}", fontsize=8, pad=24)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
