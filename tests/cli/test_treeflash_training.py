"""TreeFlash distillation: per-depth views line up with the target, one loss step lowers KL, the plot draws.

A tiny hybrid target; the full ``stree train drafter --kind treeflash`` run (corpus + BPE target) is
exercised by the lead on the GPU.
"""

from __future__ import annotations

import argparse

import torch

from stree.bench.e2e import make_drafter
from stree.training.treeflash import depth_views, eval_treeflash, plot_treeflash, treeflash_losses
from stree.verifier.model.treeflash import TreeFlashConfig, TreeFlashNet, save_treeflash


def test_depth_views_match_the_target_and_training_lowers_kl(models, tmp_path):
    target = models["hybrid"]
    x = torch.randint(0, 64, (2, 11))
    hidden, roots, parents, t_logp = depth_views(target, x, depth=3)
    logits, h = target(x[:, :-1], return_hidden=True)
    p = 10 - 3
    assert hidden.shape == (2 * p, 32) and parents.shape == (2 * p, 3) and t_logp.shape == (2 * p, 3, 64)
    # row (window 1, position 2): hidden h_2, root x_3, depth-k parent x_{3+k}, target law after x_{3+k}
    row = p + 2
    torch.testing.assert_close(hidden[row], h[1, 2])
    assert roots[row] == x[1, 3] and parents[row].tolist() == x[1, 3:6].tolist()
    torch.testing.assert_close(t_logp[row, 2], torch.log_softmax(logits[1, 5], -1))

    net = TreeFlashNet(TreeFlashConfig(d_target=32, vocab_size=64, d_model=16, depth=3, n_layer=1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    before = eval_treeflash(target, net, [x])
    for _ in range(15):
        kl_c, kl_m, *_ = treeflash_losses(target, net, x)
        opt.zero_grad()
        (kl_c + kl_m).backward()
        opt.step()
    after = eval_treeflash(target, net, [x])
    assert after["val_kl"] < before["val_kl"] and after["val_kl_marginal"] < before["val_kl_marginal"]
    log = {"loss": [(1, 2.0), (2, 1.5)], "evals": [(2, after)], "config": {"depth": 3}, "params": 1000,
           "device": "cpu"}
    plot_treeflash(log, tmp_path / "tf.png")
    assert (tmp_path / "tf.png").stat().st_size > 0

    args = argparse.Namespace(treeflash=str(save_treeflash(net, tmp_path / "tf")), treeflash_tree="chain:3",
                              device="cpu")
    for method in ("treeflash", "treeflash-marginal"):
        assert make_drafter(method, None, None, args).name == method
