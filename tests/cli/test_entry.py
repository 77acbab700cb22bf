"""The console script's entry point (``recall.cli.main``): ``import recall`` loads nothing heavy, and a signal while the
command line loads is one line and the signal's exit status, not a traceback."""
from __future__ import annotations

import builtins
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from processes import python_code

import recall
from recall.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_import_recall_loads_nothing_heavy_and_names_resolve():
    done = python_code("import sys, recall; heavy = [m for m in ('numpy', 'pyarrow', 'typer', 'recall.engine') "
                   "if m in sys.modules]; print(heavy); from recall import Engine, InputError, read_embeddings; "
                   "print(Engine.__module__, InputError.__module__, recall.__version__)")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[]", lines
    assert lines[1] == f"recall.engine.engine recall.core.errors {recall.__version__}"
    assert set(recall.__all__) <= set(dir(recall))
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        recall.nothing  # noqa: B018


def test_ctrl_c_while_the_command_line_loads(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    real = builtins.__import__

    def interrupted(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "app" and level == 1:
            raise KeyboardInterrupt
        return real(name, globals, locals, fromlist, level)

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(builtins, "__import__", interrupted)
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted by SIGINT (Ctrl-C): nothing done"]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # the handlers restored


# SIGTERM sent by the process to itself while recall.cli.app is imported, or once it is, as the arguments are parsed
# (before any command's own handling): one line, exit 143.
_SIGTERM_AT = {
    "while the command line loads": ("import builtins\n"
                                     "real = builtins.__import__\n"
                                     "def imp(name, globals=None, locals=None, fromlist=(), level=0):\n"
                                     "    if name == 'app' and level == 1:\n"
                                     "        os.kill(os.getpid(), signal.SIGTERM)\n"
                                     "    return real(name, globals, locals, fromlist, level)\n"
                                     "builtins.__import__ = imp\n"),
    "before the command begins": ("import recall.cli.app as app\n"
                                  "real = app.app\n"
                                  "def started(*a, **k):\n"
                                  "    os.kill(os.getpid(), signal.SIGTERM)\n"
                                  "    return real(*a, **k)\n"
                                  "app.app = started\n"),
}


@pytest.mark.parametrize("when", list(_SIGTERM_AT))
def test_a_sigterm_before_any_command_is_one_line(when: str):
    done = python_code(f"import os, signal, sys\n{_SIGTERM_AT[when]}sys.argv = ['recall', '--version']\n"
                       "from recall.cli import main\nmain()\n")
    assert done.returncode == 143, (done.returncode, done.stderr)
    assert done.stderr.splitlines() == ["terminated by SIGTERM: nothing done"], done.stderr
    assert done.stdout == ""


def test_python_dash_m_recall_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "recall", "--version"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, check=False)
    assert done.returncode == 0 and done.stdout.startswith("recall "), done.stderr
