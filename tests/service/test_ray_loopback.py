"""The drafter service's local Ray instance listens on loopback only: every listening socket of every Ray
process it starts (GCS, raylet, workers, dashboard and runtime-env agents) and of the driver itself is on
127.0.0.0/8 or ::1 (before: the GCS, raylet, workers and dashboard agent listened on 0.0.0.0 / [::])."""

from __future__ import annotations

import ipaddress

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")

from service_helpers import drafter_service  # noqa: E402


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _listening() -> dict[str, list[str]]:
    """``name (pid)`` -> listening addresses, for this process and all its descendants."""
    me = psutil.Process()
    out = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            addrs = [f"{c.laddr.ip}:{c.laddr.port}" for c in proc.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
            out[f"{proc.name()} ({proc.pid})"] = addrs
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def test_every_ray_process_listens_on_loopback_only():
    with drafter_service(["ngram"]):  # started with its ngram replica (a Ray worker actor) up
        listening = _listening()
    names = " ".join(listening)
    assert "gcs_server" in names and "raylet" in names and "ray::DrafterReplica" in names, names
    exposed = {name: [a for a in addrs if not _loopback(a.rsplit(":", 1)[0])] for name, addrs in listening.items()}
    assert not any(exposed.values()), {k: v for k, v in exposed.items() if v}
