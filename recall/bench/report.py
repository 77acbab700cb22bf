"""Reports of a benchmark run: a table on the terminal, results.json (every raw number), results.md, a PNG plot."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

JSON_NAME = "results.json"
MD_NAME = "results.md"
PNG_NAME = "throughput.png"

COLUMNS = ("workload", "kind", "device", "contender", "median s", "users/s", "TFLOP/s", "recall@k", "vs FAISS",
           "note")


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
    if row["mode"] == "e2e":
        notes.append("Parquet to Parquet")
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
    if stats.get("fallback_users"):
        notes.append(f"exact fallback for {stats['fallback_users']:,} users")
    if repeats and len(row["times_s"]) > 1:
        notes.append("runs " + ", ".join(f"{t:.3g}" for t in row["times_s"]) + " s")
    return "; ".join(notes)


def rows_as_text(doc: dict[str, Any], repeats: bool = True) -> list[list[str]]:
    """One list of cell texts per result row, in ``COLUMNS`` order; ``repeats`` lists every timed run in the note."""
    out = []
    for r in doc["results"]:
        name = r["contender"] + (" (e2e)" if r["mode"] == "e2e" else "")
        out.append([r["workload"], r["kind"], r["device"], name, _num(r["median_s"], 4), _num(r["users_per_s"]),
                    _num(r["tflops"]), _recall(r), _num(r["vs_faiss"]) + ("x" if r["vs_faiss"] else ""),
                    _note(r, repeats)])
    return out


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
    if e.get("git_commit"):
        parts.append(f"recall {e['git_commit']}")
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
    return console


def print_table(doc: dict[str, Any], console: Any = None) -> None:
    """The results as a rich table, then the floors and the environment."""
    from rich.table import Table

    console = console or make_console()
    table = Table(title="recall bench", show_lines=False)
    for col in COLUMNS:
        table.add_column(col, justify="right" if col not in ("workload", "kind", "device", "contender", "note")
                         else "left", overflow="fold")
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
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("| " + " | ".join("---" if c in ("workload", "kind", "device", "contender", "note") else "---:"
                                   for c in COLUMNS) + " |")
    for cells in rows_as_text(doc):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    floors = floor_lines(doc)
    if floors:
        lines.append("")
        lines += [f"- {f}" for f in floors]
    s = doc["settings"]
    lines.append("")
    lines.append(f"Median of {s['repeat']} timed runs after one warm-up; recall@k against a float64 oracle on "
                 f"{s['sample_users']} sampled users (tie-aware, rtol {s['rtol']:g}); seed {s['seed']}.")
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
    names = list(dict.fromkeys(r["contender"] + (" (e2e)" if r["mode"] == "e2e" else "") for r in ok))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.5))
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            for r in ok:
                label = r["contender"] + (" (e2e)" if r["mode"] == "e2e" else "")
                if f"{r['workload']}\n{r['kind']}" == w and label == name:
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


def write(doc: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Write results.json, results.md and throughput.png into ``out_dir`` (created); returns {file: status}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    status = {}
    doc["plot"] = plot(doc, out_dir / PNG_NAME)
    status[PNG_NAME] = doc["plot"]
    (out_dir / JSON_NAME).write_text(json.dumps(_jsonable(doc), indent=2) + "\n")
    status[JSON_NAME] = f"wrote {out_dir / JSON_NAME}"
    (out_dir / MD_NAME).write_text(markdown(doc))
    status[MD_NAME] = f"wrote {out_dir / MD_NAME}"
    return status
