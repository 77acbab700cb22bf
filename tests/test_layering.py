"""The layout holds: the import-linter contracts of pyproject.toml, no import cycle, and every module importable on
its own in a fresh interpreter (the import order of a test run must not be what makes a module work)."""
from __future__ import annotations

import logging
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import recall

REPO = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    lint_imports = pytest.importorskip("importlinter.cli").lint_imports

    monkeypatch.chdir(REPO)  # the contracts are in pyproject.toml
    # import-linter configures logging with every existing logger disabled ("recall" too: the notices of the tests
    # that run after it would be lost): put each logger back as it was.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = [lg.disabled for lg in loggers]
    try:
        code = lint_imports(no_cache=True, no_logo=True)
    finally:
        for lg, was in zip(loggers, disabled):
            lg.disabled = was
    out = capsys.readouterr().out
    assert code == 0, out
    assert "0 broken" in out


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    scc.append(top)
                    if top == node:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return out


def test_no_import_cycles() -> None:
    # Every import counts, those inside functions too: a lazy import that closes a cycle is still a cycle.
    grimp = pytest.importorskip("grimp")
    assert _cycles(grimp.build_graph("recall")) == []


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(recall.__path__, "recall.") if not m.name.endswith("__main__"))


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    def try_import(name: str) -> tuple[str, int, str]:
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, cwd=REPO)
        return name, proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]

    with ThreadPoolExecutor(8) as pool:
        failed = [f"{name}: {err}" for name, code, err in pool.map(try_import, _modules()) if code]
    assert not failed, "\n".join(failed)
