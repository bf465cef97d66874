"""Training the demo pair on a tiny corpus: the loss falls, the drafter learns the target, checkpoints load back."""

from __future__ import annotations

import json

import pytest
import torch

from corpus_helpers import toy_site

from stree.training.corpus import build_corpus
from stree.training.loop import lr_at
from stree.training.train import Shape, TrainConfig, train_pair
from stree.verifier.model.checkpoint import load_model
from stree.verifier.decode.loop import generate
from stree.verifier.model.tokenizer import load_tokenizer


def test_corpus_is_deterministic_and_split(tmp_path):
    root = toy_site(tmp_path)
    a = build_corpus(["toypkg"], max_bytes=10**6, roots=[root])
    b = build_corpus(["toypkg"], max_bytes=10**6, roots=[root])
    assert a.train == b.train and a.val == b.val
    assert a.train and a.val and a.meta["files"] == 12
    with pytest.raises(ValueError, match="none of the packages"):
        build_corpus(["no_such_package_here"], roots=[root])


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 100, 10, 1.0) for s in range(100)]
    assert lrs[0] < lrs[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    cfg = TrainConfig(out=str(tmp / "ckpt"), vocab_size=300, target=Shape(32, 2, (1,), 8, 8, 16),
                      draft=Shape(32, 1, (), 8, 8), target_steps=60, draft_steps=40, batch_size=4, seq_len=32,
                      target_lr=3e-3, draft_lr=3e-3, warmup=5, eval_every=20, eval_batches=1,
                      packages=("toypkg",), corpus_roots=[toy_site(tmp)], corpus_bytes=10**6,
                      tokenizer_bytes=10**6, device="cpu", seed=0)
    return train_pair(cfg), tmp / "ckpt"


def test_training_lowers_loss_and_distills(trained):
    log, out = trained
    t_evals = [m["val_ce"] for _, m in log["target"]["evals"]]
    d_evals = [m["val_kl"] for _, m in log["draft"]["evals"]]
    assert t_evals[-1] < t_evals[0] - 0.5  # the target learned the corpus
    assert d_evals[-1] < d_evals[0]  # the drafter moved towards the target
    assert (out / "train_loss.png").stat().st_size > 0
    assert json.loads((out / "train_log.json").read_text())["params"]["target"] == log["params"]["target"]


def test_trained_pair_loads_and_speculation_is_exact(trained):
    _, out = trained
    target = load_model(out / "demo-target")
    draft = load_model(out / "demo-draft")
    assert target.config.attn_layer_idx == [1] and not draft.config.attn_layer_idx
    assert load_tokenizer(out / "demo-target").get_vocab_size() == target.vocab_size == draft.vocab_size
    with torch.no_grad():
        plain = generate(target, [5, 6, 7, 8], max_new_tokens=20).token_ids
        spec = generate(target, [5, 6, 7, 8], drafter="mamba", draft_model=draft, tree="beam:3x2",
                        max_new_tokens=20)
    assert spec.token_ids == plain
    assert spec.stats["mean_accepted_length"] > 1.0  # the distilled drafter gets tokens accepted
