"""The ``stree`` console script: init-model, generate (text and JSON), and clear errors for bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stree.cli import main


def _run(*args: str):
    return subprocess.run([sys.executable, "-m", "stree.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cli_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    for name, arch, layers in (("target", "hybrid", "3"), ("draft", "mamba2", "1")):
        rc = main(["init-model", str(root / name), "--arch", arch, "--d-model", "32", "--n-layer", layers,
                   "--vocab-size", "320", "--d-state", "8", "--headdim", "8", "--seed", "4"]
                  + (["--attn-layers", "1"] if arch == "hybrid" else []))
        assert rc == 0
    return root


def test_generate_json_matches_plain_for_each_drafter(cli_models, capsys):
    outs = {}
    for drafter, extra in (("none", []), ("chain", []), ("static-tree", []), ("ngram", ["--lookup-tree", "trie:3x2"]),
                           ("fusion:mamba+ngram", ["--tree", "beam:2x2", "--lookup-tree", "chain:3"])):
        rc = main(["generate", str(cli_models / "target"), "--draft-model", str(cli_models / "draft"),
                   "--drafter", drafter, "--prompt-ids", "1,2,3,1,2,3,1", "--max-new-tokens", "9", "--json",
                   "--tree-widths", "3,2,2,1", "--ignore-eos"] + extra)
        assert rc == 0
        rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert {"token_ids", "text", "stats"} <= set(rec)
        assert {"steps", "mean_accepted_length", "tokens_per_s"} <= set(rec["stats"])
        outs[drafter] = rec["token_ids"]
    assert outs["none"] == outs["chain"] == outs["static-tree"] == outs["ngram"] == outs["fusion:mamba+ngram"]
    assert len(outs["none"]) == 9
    assert main(["generate", str(cli_models / "target"), "--drafter", "ngram", "--prompt-ids", "1",
                 "--lookup-tree", "beam:2x2"]) == 2
    assert "a lookup tree is chain:K or trie:DxW" in capsys.readouterr().err


def test_generate_with_a_treeflash_checkpoint_as_the_draft_model(cli_models, tmp_path, capsys):
    """--draft-model may name a TreeFlash checkpoint: the default drafter is then treeflash, and the
    greedy output equals plain decoding."""
    import torch

    from stree.verifier.model.checkpoint import load_model
    from stree.verifier.model.treeflash import TreeFlashConfig, TreeFlashNet, save_treeflash

    target = load_model(cli_models / "target")
    torch.manual_seed(0)
    save_treeflash(TreeFlashNet(TreeFlashConfig(d_target=target.config.d_model, vocab_size=target.vocab_size,
                                                d_model=16, depth=3)), tmp_path / "tf")
    outs = {}
    for extra in ([], ["--drafter", "none"]):
        rc = main(["generate", str(cli_models / "target"), "--draft-model", str(tmp_path / "tf"), "--prompt-ids",
                   "1,2,3", "--max-new-tokens", "9", "--json", "--ignore-eos", *extra])
        assert rc == 0
        rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        outs[rec["drafter"]] = rec["token_ids"]
    assert outs["treeflash"] == outs["none"] and len(outs["none"]) == 9


def test_generate_text_prompt_and_samples(cli_models, capsys):
    rc = main(["generate", str(cli_models / "target"), "--prompt", "def main():", "--max-new-tokens", "5",
               "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "1", "--num-samples", "2",
               "--json", "--draft-model", str(cli_models / "draft"), "--ignore-eos"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    recs = [json.loads(x) for x in lines]
    assert all(isinstance(r["text"], str) and len(r["token_ids"]) == 5 for r in recs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,x"], "--prompt-ids wants comma-separated integers"),
        (["--prompt-ids", "1", "--drafter", "nope"], "unknown drafter 'nope'"),
        (["--prompt-ids", "1", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt-ids", "1", "--top-p", "0"], "top_p must be in"),
        (["--prompt-ids", "1", "--drafter", "mamba", "--tree", "beam:0x3"], "bad numbers"),
        (["--prompt-ids", "1,999"], "prompt token id 999 is outside the vocabulary"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    ],
)
def test_bad_arguments_give_clear_errors(cli_models, args, message):
    proc = _run("generate", str(cli_models / "target"), "--draft-model", str(cli_models / "draft"), *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_argparse_level_errors(cli_models, tmp_path):
    proc = _run("generate", str(cli_models / "target"))
    assert proc.returncode == 2 and "one of the arguments --prompt --prompt-ids is required" in proc.stderr
    proc = _run("generate", str(tmp_path / "missing"), "--prompt-ids", "1")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = _run("init-model", str(tmp_path / "x"), "--arch", "transformer")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_generate_reads_tokenizer_dir_and_generation_config_eos(cli_models, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(cli_models / "target", model)
    (model / "tokenizer.json").unlink()
    base = ["generate", str(model), "--prompt", "def f", "--max-new-tokens", "6", "--json",
            "--tokenizer", str(cli_models / "target")]
    assert main(base + ["--ignore-eos"]) == 0
    free = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[1]]}))
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == free[: free.index(free[1]) + 1]


def test_help_shows_each_default_once_on_every_subcommand():
    import argparse

    from stree.cli import build_parser
    from stree.cli.help_format import parsers_under, shows_default

    checked = 0
    for parser in parsers_under(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            text = formatter._format_action(action)
            assert text.count("(default") <= 1, f"{parser.prog} {action.option_strings}: {text}"
            if shows_default(action):
                assert "(default" in text, f"{parser.prog} {action.option_strings} hides its default: {text}"
                checked += 1
            assert "(default: None)" not in text and not isinstance(action.default, argparse.Namespace)
    assert checked > 50
    proc = _run("serve", "--help")
    assert proc.returncode == 0
    assert "(default: MODEL_DIR)" in proc.stdout and "(default: None)" not in proc.stdout
    assert "(default: 50051)" in proc.stdout


def test_generate_compare_plain_prints_the_speedup_and_equality(cli_models, capsys):
    args = ["generate", str(cli_models / "target"), "--draft-model", str(cli_models / "draft"), "--drafter", "chain",
            "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--ignore-eos", "--compare-plain", "--compare-runs", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("[compare] plain"))
    assert "(medians of 2 runs)" in line and "x plain; output equals plain decoding: yes" in line
    assert main(args + ["--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cmp = rec["compare_plain"]
    assert cmp["equals_plain"] is True and cmp["runs"] == 2
    assert cmp["speedup"] == pytest.approx(cmp["tokens_per_s"] / cmp["plain_tokens_per_s"])
    assert main(args + ["--temperature", "1", "--seed", "3"]) == 0
    assert "sampled: speculation keeps the output's distribution" in capsys.readouterr().out


def test_demo_reports_medians_of_interleaved_runs_and_exact_outputs(cli_models, capsys):
    assert main(["demo", "--target", str(cli_models / "target"), "--draft", str(cli_models / "draft"),
                 "--max-new-tokens", "6", "--runs", "2", "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr().out
    assert "median of 2 runs of 6 tokens" in out
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["runs"] == 2 and len(rec["rows"]) == 5
    for row in rec["rows"]:
        assert len(row["tokens_per_s_runs"]) == 2 and row["identical_to_plain"]
        assert min(row["tokens_per_s_runs"]) <= row["tokens_per_s"] <= max(row["tokens_per_s_runs"])
    assert ("too noisy to compare" in out) == rec["too_noisy_to_compare"]


def test_noise_is_the_spread_of_a_methods_runs():
    from stree.cli.timing import TimedRuns, noise_warning, noisy

    quiet, loud = TimedRuns(None, [100.0, 104.0, 98.0]), TimedRuns(None, [100.0, 60.0, 130.0])
    assert quiet.median == 100.0 and quiet.spread == pytest.approx(0.06)
    assert noisy({"plain": quiet, "chain": quiet}) == []
    assert noisy({"plain": quiet, "chain": loud}) == ["chain"]
    assert "chain 70 %" in noise_warning(["chain"], {"chain": loud})
    assert noisy({"plain": TimedRuns(None, [100.0])}) == []  # one run: nothing to say
