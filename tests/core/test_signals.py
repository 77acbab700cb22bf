"""The signal policy (``recall.core.signals.raising_signals``)."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import pytest

from recall.core.signals import Interrupted, raising_signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_that_lands_in_a_c_callback_still_unwinds_the_block(capfd, signum):
    # numba compiles through llvmlite's ctypes callbacks: a signal raised there is only reported by Python ("Exception
    # ignored on calling ctypes callback function") and the command went on to its end. It is sent again and unwinds
    # the block at its next line of Python, with nothing printed.
    hook = sys.unraisablehook
    callback = ctypes.CFUNCTYPE(None)(lambda: os.kill(os.getpid(), signum))
    after = []
    with pytest.raises(Interrupted) as caught:
        with raising_signals():
            callback()
            after.append("the callback returned")
            time.sleep(5)
            after.append("still running")
    assert caught.value.signum == signum and caught.value.code == 128 + signum
    assert after == ["the callback returned"]
    assert "Exception ignored" not in capfd.readouterr().err
    assert sys.unraisablehook is hook and signal.getsignal(signal.SIGTERM) is not None


def test_other_unraisable_exceptions_go_to_the_hook_before(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: seen.append(info.exc_value))

    def fail():
        raise ValueError("from a callback")

    with raising_signals():
        ctypes.CFUNCTYPE(None)(fail)()
    assert [type(e) for e in seen] == [ValueError]
