"""The README's examples run as written on a CPU machine: its Python API block as it stands, and its client blocks
(stree.Client, the OpenAI client, curl) against a real ``stree serve`` started with the README's own serve command,
on loopback. Only the ports change, to free ones."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grpc

from service_helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
GRPC_PORT, HTTP_PORT = "50051", "8000"  # the ports the README's serve command and clients use
SERVE_PREFIX = "stree serve checkpoints/demo-target"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.S | re.M)


def needs_server(block: str) -> bool:
    return "stree.Client(" in block or "OpenAI(" in block


def cpu_env() -> dict:
    """The environment of a CPU machine: no GPU visible, the repository importable as installed."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def run_python(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cpu_env(), capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_python_api_example_runs_as_written():
    blocks = [b for b in code_blocks("python") if not needs_server(b)]
    assert blocks, "README.md has no Python API example"
    for block in blocks:
        proc = run_python(block)
        assert proc.returncode == 0, f"README example failed:\n{block}\n--- stderr:\n{proc.stderr[-3000:]}"
        assert proc.stdout.strip()


def readme_serve_command() -> list[str]:
    """The README's ``stree serve`` command for the demo pair, as argv after ``stree``."""
    lines = [line for b in code_blocks("bash") for line in b.splitlines() if line.startswith(SERVE_PREFIX)]
    assert len(lines) == 1, f"README.md should show one `{SERVE_PREFIX} ...` command, found {lines}"
    return shlex.split(lines[0])[1:]


def with_ports(text: str, grpc_port: int, http_port: int) -> str:
    return text.replace(f":{GRPC_PORT}", f":{grpc_port}").replace(f":{HTTP_PORT}", f":{http_port}")


def test_the_readme_client_examples_run_against_the_readme_serve_command(tmp_path):
    import stree

    argv = readme_serve_command()
    assert argv[argv.index("--http-port") + 1] == HTTP_PORT and "--port" not in argv  # gRPC on the default port
    grpc_port, http_port = free_port(), free_port()
    argv[argv.index("--http-port") + 1] = str(http_port)
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "stree.cli", *argv, "--port", str(grpc_port)], cwd=REPO,
                                  env=cpu_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        client = stree.Client(f"127.0.0.1:{grpc_port}", timeout=5)

        def serving() -> bool:
            assert server.poll() is None, f"stree serve exited:\n{log.read_text()[-3000:]}"
            try:
                return client.health() == "SERVING"
            except grpc.RpcError:  # not listening yet
                return False

        assert wait_until(serving, 300), f"stree serve did not start:\n{log.read_text()[-3000:]}"
        client.close()
        blocks = [b for b in code_blocks("python") if needs_server(b)]
        assert any("stree.Client(" in b for b in blocks) and any("OpenAI(" in b for b in blocks)
        for block in blocks:
            proc = run_python(with_ports(block, grpc_port, http_port), timeout=300)
            assert proc.returncode == 0, (f"README example failed:\n{block}\n--- stderr:\n{proc.stderr[-3000:]}"
                                          f"\n--- server log:\n{log.read_text()[-2000:]}")
            assert proc.stdout.strip()
        curls = [b for b in code_blocks("bash") if b.startswith("curl ")]
        assert len(curls) == 1
        if shutil.which("curl"):
            proc = subprocess.run(["bash", "-c", with_ports(curls[0], grpc_port, http_port)], capture_output=True,
                                  text=True, timeout=300)
            assert proc.returncode == 0 and '"choices"' in proc.stdout, proc.stdout + proc.stderr
    finally:
        stop(server)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains and exits), SIGKILL if it is still there after a minute."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)
