"""Run a command's real work in a child process group, so nothing it started outlives it.

The parent (the pid an operator signals) forwards SIGINT/SIGTERM to the child and, once the child
has exited for any reason (SIGKILL included), kills whatever is left in the child's process group
(Ray's agents outlive a killed driver otherwise). If the parent itself is SIGKILLed, the kernel sends
the child SIGTERM (PR_SET_PDEATHSIG) and the child shuts down cleanly.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

SUPERVISED_ENV = "STREE_SUPERVISED"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def is_supervised() -> bool:
    return os.environ.get(SUPERVISED_ENV) == "1"


def run_supervised(argv: list[str]) -> int:
    """``python -m stree.cli *argv`` in its own process group; its exit code (128+N for signal N)."""
    env = dict(os.environ, **{SUPERVISED_ENV: "1"})
    child = subprocess.Popen([sys.executable, "-m", "stree.cli", *argv], env=env, start_new_session=True,
                             preexec_fn=_die_with_parent)
    forward = lambda signum, _frame: child.send_signal(signal.SIGTERM)  # noqa: E731
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            os.killpg(child.pid, signal.SIGKILL)  # leftovers only: the child itself has exited
        except (ProcessLookupError, PermissionError):
            pass
    return 128 - rc if rc < 0 else rc
