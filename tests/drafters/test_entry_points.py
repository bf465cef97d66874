"""Third-party drafters: a separately installed package is found through the ``stree.drafters`` entry point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN_DIR = Path(__file__).parent / "plugin_pkg"
PLUGIN_DIST = "stree-echo-plugin"


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def echo_plugin(tmp_path_factory):
    """Install the echo plugin package into this environment; uninstall it afterwards."""
    src = tmp_path_factory.mktemp("plugin") / "plugin_pkg"
    shutil.copytree(PLUGIN_DIR, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    done = _pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(src))
    assert done.returncode == 0, done.stdout + done.stderr
    yield src
    gone = _pip("uninstall", "-y", PLUGIN_DIST)
    assert gone.returncode == 0, gone.stdout + gone.stderr


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, as a user's program would see the installed plugin."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_installed_plugin_is_listed_and_created_by_name(echo_plugin):
    code = (
        "import json, stree\n"
        "from stree import DraftBudget, SamplingParams\n"
        "names = stree.available_drafters()\n"
        "drafter = stree.create_drafter('echo', length=3)\n"
        "session = drafter.open([4, 5, 6], SamplingParams())\n"
        "tree = session.draft(DraftBudget(max_nodes=16, max_depth=8, max_width=2))\n"
        "session.commit([6, 7])\n"
        "after = session.draft(DraftBudget(max_nodes=3, max_depth=8, max_width=2))\n"
        "print(json.dumps({'names': names, 'name': drafter.name, 'tree': tree.tokens.tolist(),\n"
        "                  'parents': tree.parents.tolist(), 'after': after.tokens.tolist()}))\n"
    )
    run = _python(code)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "echo" in out["names"] and "ngram" in out["names"] and "retrieval" in out["names"]
    assert out["name"] == "echo"
    assert out["tree"] == [6, 6, 6, 6] and out["parents"] == [-1, 0, 1, 2]
    assert out["after"] == [7, 7, 7]


def test_plugin_options_errors_surface_as_value_errors(echo_plugin):
    run = _python("import stree\nstree.create_drafter('echo', length=-1)\n")
    assert run.returncode != 0
    assert "ValueError: echo drafter: length must be >= 0" in run.stderr


def test_cli_generates_with_the_plugin_by_name(echo_plugin, tmp_path):
    pytest.importorskip("stree.cli.generate")
    import torch

    import stree
    from stree.verifier.model.checkpoint import init_model

    model_dir = init_model(tmp_path / "model", arch="mamba2", d_model=32, n_layer=2, d_state=8, headdim=8,
                           vocab_size=64, seed=5)
    stree_script = Path(sys.executable).parent / "stree"
    command = [str(stree_script)] if stree_script.exists() else [sys.executable, "-m", "stree.cli"]
    run = subprocess.run(
        command + ["generate", str(model_dir), "--drafter", "echo", "--prompt-ids", "1,2,3",
                   "--max-new-tokens", "8", "--json", "--device", "cpu", "--ignore-eos"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["drafter"] == "echo"
    plain = stree.generate(stree.load_model(model_dir, dtype=torch.float32), [1, 2, 3], drafter=None,
                           max_new_tokens=8)
    assert out["token_ids"] == plain.token_ids  # speculation with a plugin never changes the output
    assert len(out["token_ids"]) == 8


@pytest.mark.parametrize("name, needed", [("retrieval", "datastore"), ("fusion", "drafters")])
def test_a_drafter_missing_a_required_option_is_a_value_error(name, needed):
    """A built-in drafter named without what it needs (a server started without a datastore, say) is a clear
    ValueError naming the option (the servers answer INVALID_ARGUMENT), not a TypeError from its constructor."""
    from stree.protocols.registry import create_drafter

    with pytest.raises(ValueError, match=f"{name!r} needs {needed}"):
        create_drafter(name)
