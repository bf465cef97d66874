"""A folder that looks like site-packages, holding one small package of Python files: an offline training corpus."""

from __future__ import annotations

from pathlib import Path


def toy_site(root: Path, files: int = 12) -> Path:
    """``root/site/toypkg/mod_*.py``; returns ``root/site`` (pass it as a corpus root with packages ``toypkg``)."""
    pkg = root / "site" / "toypkg"
    pkg.mkdir(parents=True)
    body = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(40))
    for k in range(files):
        (pkg / f"mod_{k}.py").write_text(f'"""Module {k}."""\n\nimport os\n\n' + body)
    return root / "site"
