"""Hugging Face Hub ids load as transformers loads them: read from the local Hugging Face cache offline (a cache
this test writes in huggingface_hub's own layout), with a clear message when the id is in neither the cache nor a
local folder, worded for the Python API there and for the command line in the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from stree.verifier.model.checkpoint import init_model, load_model

REVISION = "0123456789abcdef0123456789abcdef01234567"

SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys
    import torch
    import stree
    from stree.cli import build_parser, main
    from stree.cli.serve import _served_name

    local = sys.argv[1]
    out = {}
    hub, ref = stree.load_model("org/tiny"), stree.load_model(local)
    ids = torch.tensor([[1, 2, 3, 4]])
    out["same_logits"] = bool(torch.equal(hub(ids), ref(ids)))
    out["source_dir"] = hub.source_dir
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        out["generate_rc"] = main(["generate", "org/tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                                   "--device", "cpu", "--json", "--eager"])
    out["generate"] = json.loads(text.getvalue().splitlines()[0])
    out["served_name"] = _served_name(build_parser().parse_args(["serve", "org/tiny"]))
    try:
        stree.load_model("org/missing")
    except FileNotFoundError as exc:
        out["api_error"] = str(exc)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(["generate", "org/missing", "--prompt-ids", "1"])
        except SystemExit as exc:
            out["cli_exit"] = exc.code
    out["cli_error"] = err.getvalue()
    print(json.dumps(out))
""")


def _write_cache(hf_home, repo_id: str, folder) -> None:
    """``folder``'s files as huggingface_hub caches a download of ``repo_id`` at ``REVISION`` (branch main)."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


def test_hub_id_reads_the_offline_cache_in_python_and_the_cli(tmp_path):
    local = init_model(tmp_path / "tiny", d_model=16, n_layer=1, vocab_size=32, d_state=8, headdim=8, seed=3)
    _write_cache(tmp_path / "hf", "org/tiny", local)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(local)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["same_logits"] and out["source_dir"].endswith(f"snapshots/{REVISION}")
    assert out["generate_rc"] == 0 and len(out["generate"]["token_ids"]) == 3
    assert out["served_name"] == "org/tiny"
    assert "'org/missing' is neither a local folder nor a Hugging Face Hub model" in out["api_error"]
    assert "HF_HUB_OFFLINE" in out["api_error"] and "--" not in out["api_error"]
    assert out["cli_exit"] == 2
    assert "argument MODEL_DIR: 'org/missing' is neither a local folder" in out["cli_error"]


def test_local_files_only_names_the_cache_and_the_option(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match="offline \\(local_files_only=True\\)") as err:
        load_model("nobody/nothing-here", local_files_only=True)
    assert str(tmp_path / "empty-cache") in str(err.value)


def test_paths_that_are_not_hub_ids_say_the_folder_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        load_model(init_model(tmp_path / "m", d_model=16, n_layer=1, vocab_size=32, d_state=8, headdim=8)
                   / "config.json")
