"""Data parallelism and resuming: the same seed and global batch give the same loss curve on one process (two
micro-batches) and on two (``stree train --gpus 2``: torchrun, DDP over gloo); a phase stopped mid-way and
resumed ends where an uninterrupted one does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from corpus_helpers import toy_site

from stree.training.distributed import DistEnv, rank_rows
from stree.training.loop import PhaseConfig, run_phase
from stree.training.model_shape import Shape, make_model
from stree.training.run_settings import RunSettings
from stree.training.train import TrainConfig, lm_loss, train_pair
from stree.training.fast_forward import TrainForward

TINY = dict(vocab_size=300, target=Shape(32, 2, (1,), 8, 8, 16), target_steps=10, draft_steps=0, batch_size=4,
            seq_len=32, warmup=2, eval_every=5, eval_batches=2, packages=("toypkg",), corpus_bytes=10**6)


def test_two_processes_give_the_loss_curve_of_one(tmp_path):
    site = toy_site(tmp_path)
    one = train_pair(TrainConfig(out=str(tmp_path / "one"), corpus_roots=[site], cache_dir=str(tmp_path / "cache"),
                                 run=RunSettings(micro_batch=2, workers=1), **TINY))
    cmd = [sys.executable, "-m", "stree.cli", "train", "--gpus", "2", "--device", "cpu", "--out", str(tmp_path / "two"),
           "--corpus-root", str(site), "--packages", "toypkg", "--cache-dir", str(tmp_path / "cache"),
           "--workers", "1", "--vocab-size", "300", "--target-d-model", "32", "--target-layers", "2",
           "--target-attn-layers", "1", "--d-state", "8", "--headdim", "8", "--steps", "10", "--draft-steps", "0",
           "--batch-size", "4", "--seq-len", "32", "--warmup", "2", "--eval-every", "5", "--eval-batches", "2",
           "--corpus-bytes", str(10**6)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "train_log.json").read_text())
    assert two["processes"] == 2 and one["processes"] == 1
    a, b = one["target"]["loss"], two["target"]["loss"]
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(10))
    for (_, x), (_, y) in zip(a, b):
        assert x == pytest.approx(y, rel=2e-3, abs=2e-3)
    assert a[-1][1] < a[0][1]  # and it learns
    for (s1, m1), (s2, m2) in zip(one["target"]["evals"], two["target"]["evals"]):
        assert s1 == s2 and m1["val_ce"] == pytest.approx(m2["val_ce"], rel=2e-3)


def test_rank_rows_split_the_global_batch():
    assert rank_rows(8, DistEnv(rank=1, world_size=4)) == slice(2, 4)
    with pytest.raises(ValueError, match="batch size 6 does not split over 4 processes"):
        rank_rows(6, DistEnv(rank=0, world_size=4))


class _Stop(Exception):
    pass


def test_a_resumed_phase_ends_where_an_uninterrupted_one_does(tmp_path, models):
    data = torch.randint(0, 64, (64, 17))

    def batches(stop_at=None):
        def next_batch(step):
            if step == stop_at:
                raise _Stop()
            g = torch.Generator().manual_seed(step)
            return data[torch.randint(0, 64, (4,), generator=g)]
        return next_batch

    def phase(resume, ckpt):
        return PhaseConfig(steps=12, lr=3e-3, warmup=2, eval_every=100, checkpoint=str(ckpt), save_every=4,
                           resume=resume)

    def fresh():
        model = make_model(Shape(32, 2, (1,), 8, 8, 16), 64, seed=3, device="cpu")
        return model, TrainForward(model)

    full, fwd = fresh()
    want = run_phase(full, lambda x: lm_loss(fwd, x), batches(), phase(False, tmp_path / "full.pt"), "cpu")
    stopped, fwd = fresh()
    with pytest.raises(_Stop):
        run_phase(stopped, lambda x: lm_loss(fwd, x), batches(stop_at=9), phase(False, tmp_path / "r.pt"), "cpu")
    resumed, fwd = fresh()
    got = run_phase(resumed, lambda x: lm_loss(fwd, x), batches(), phase(True, tmp_path / "r.pt"), "cpu")
    assert got.resumed_from == 8 and got.steps == 12
    assert [s for s, _ in got.losses] == list(range(12))
    for (_, x), (_, y) in zip(got.losses, want.losses):
        assert x == pytest.approx(y, rel=1e-5)
    for p, q in zip(resumed.parameters(), full.parameters()):
        torch.testing.assert_close(p, q)
