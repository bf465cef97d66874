"""``stree bench scale-pair --tiny``: the GPU recipe's whole pipeline (target and Mamba2 drafter, then a TreeFlash
head, the record with the keys the training issue names) at toy size on the CPU; the pair it writes loads and
speculates exactly."""

from __future__ import annotations

import json

import pytest
import torch

from corpus_helpers import toy_site

from stree.cli import main as stree_main
from stree.bench.scale_pair import DRAFT, TARGET, TREEFLASH
from stree.verifier.decode.loop import generate
from stree.verifier.model.checkpoint import load_draft_model, load_model

KEYS = ("target_params", "target_layers", "gpus", "tokens_per_s", "mfu", "train_wall_s", "val_ppl", "draft_kl",
        "draft_top1")


def test_tiny_scale_pair_pipeline_writes_the_record_and_a_working_pair(tmp_path):
    site = toy_site(tmp_path, files=16)
    rc = stree_main(["bench", "scale-pair", "--tiny", "--out", str(tmp_path / "out"), "--results",
                     str(tmp_path / "results"), "--gpus", "1", "--device", "cpu", "--corpus-root", str(site),
                     "--packages", "toypkg", "--workers", "1", "--tag", "cpu-test"])
    assert rc == 0
    record = json.loads((tmp_path / "results" / "scale-pair-train-cpu-test.json").read_text())
    assert set(KEYS) <= set(record)
    assert record["target_layers"] == 4 and record["gpus"] == 1 and record["mfu"] is None  # no peak on a CPU
    assert record["tokens_per_s"] > 0 and record["val_ppl"] > 1 and 0 <= record["draft_top1"] <= 1
    phases = record["phase_wall_s"].values()  # each rounded to 0.1 s, as the total is
    assert record["train_wall_s"] == pytest.approx(sum(phases), abs=0.05 * (len(phases) + 1))
    assert (tmp_path / "out" / "scale-pair-train-cpu-test.json").exists()
    pair = tmp_path / "out" / "pair"
    target, draft = load_model(pair / TARGET), load_model(pair / DRAFT)
    assert target.config.attn_layer_idx == [1, 2] and sum(p.numel() for p in target.parameters()) == \
        record["target_params"]
    load_draft_model(pair / TREEFLASH)
    with torch.no_grad():
        plain = generate(target, [5, 6, 7, 8], max_new_tokens=16).token_ids
        spec = generate(target, [5, 6, 7, 8], drafter="mamba", draft_model=draft, tree="chain:3", max_new_tokens=16)
    assert spec.token_ids == plain


def test_minute_caps_take_three_positive_numbers_and_name_the_format():
    import argparse

    from stree.bench.scale_pair import minute_caps

    assert minute_caps("4,1.2,0.8") == (4.0, 1.2, 0.8)
    for bad in ("4,1", "4,x,1", "4,0,1", "-1,1,1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="TARGET,DRAFT,TREEFLASH"):
            minute_caps(bad)
