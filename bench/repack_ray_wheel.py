"""Repack Ray's wheel small enough to carry to the GPU machine (64 MiB in all): without ``ray/jars/`` (Java
workers only), native binaries stripped of their symbols, every member deflated.

Usage (on a machine that has the cp312 wheel and its dependencies' wheels, e.g. from ``pip download ray[serve]``):
``python bench/repack_ray_wheel.py ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl .whl-ray/``. The RECORD is
rewritten with the new members' hashes, so pip installs the result like the original.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DROP = ("ray/jars/",)
NATIVE = (".so", "/gcs_server", "/raylet")


def stripped(data: bytes) -> bytes:
    """``data`` (an ELF binary) without its symbol tables, when ``strip`` is there."""
    if shutil.which("strip") is None:
        return data
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        subprocess.run(["strip", "--strip-unneeded", f.name], check=True)
        return Path(f.name).read_bytes()


def repack(src: Path, dst: Path) -> Path:
    out = dst / src.name if dst.is_dir() else dst
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in zin.infolist():
            name = info.filename
            if name == record or name.startswith(DROP):
                continue
            data = zin.read(info)
            if name.startswith("ray/") and name.endswith(NATIVE):
                data = stripped(data)
            member = zipfile.ZipInfo(name, info.date_time)
            member.external_attr = info.external_attr
            member.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(member, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={digest},{len(data)}")
        lines.append(f"{record},,")
        zout.writestr(record, "\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    made = repack(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{made}: {made.stat().st_size / 2**20:.1f} MiB")
