"""``stree drafter-service`` leaves no process behind: not after SIGKILL of the pid the operator knows (its
Ray processes once outlived it), nor after SIGKILL of the serving child, nor after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("ray")

from service_helpers import wait_until  # noqa: E402


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def _descendants(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("target, sig", [("parent", signal.SIGKILL), ("server", signal.SIGKILL),
                                         ("parent", signal.SIGTERM)])
def test_no_process_outlives_the_service(target, sig):
    proc = subprocess.Popen(
        [sys.executable, "-m", "stree.cli", "drafter-service", "--port", "0", "--drafters", "ngram",
         "--replicas", "1", "--ray-num-cpus", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    left: list[int] = []
    try:
        for line in proc.stdout:
            if "listening on" in line:
                break
        else:
            pytest.fail("the drafter service did not start")
        started = _descendants(proc.pid)
        assert any("ray" in open(f"/proc/{p}/cmdline").read() for p in started if _alive(p))
        victim = proc.pid if target == "parent" else min(p for p in started if os.getpgid(p) == p)
        os.kill(victim, sig)
        proc.wait(timeout=120)
        wait_until(lambda: not any(_alive(p) for p in started), 60)
        left = [p for p in started if _alive(p)]
        assert not left, [open(f"/proc/{p}/cmdline").read()[:80] for p in left if _alive(p)]
    finally:
        for p in left:
            os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
