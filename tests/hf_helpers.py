"""Tiny random transformers models saved to disk, and checks of a loaded StreeLM against transformers' own forward."""

from __future__ import annotations

import torch

from stree.protocols.token_tree import TokenTree


def perturb_(hf_model, seed: int = 0) -> None:
    """Non-trivial D, dt bias and norm weights (transformers initialises them to constants)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith(".D") or "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-3.0, 0.0, generator=g))


def save_tiny(hf_model, out_dir, shard: str | None = None):
    hf_model.save_pretrained(str(out_dir), max_shard_size=shard) if shard else hf_model.save_pretrained(str(out_dir))
    return out_dir


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def check_scores(model, hf_model, vocab: int, prefix_len: int = 7, atol: float = 1e-4) -> None:
    """score_sequence equals HF logits; score_tree at every node equals HF's forward of the root-to-node path."""
    ids = torch.randint(0, vocab, (prefix_len + 5,)).tolist()
    torch.testing.assert_close(model.score_sequence(ids), hf_logits(hf_model, ids), atol=atol, rtol=1e-4)
    toks = torch.randint(0, vocab, (7,)).tolist()
    tree = TokenTree.from_parents(toks, [-1, 0, 0, 1, 1, 2, 4])
    prefix = ids[:prefix_len]
    got = model.score_tree(prefix, tree)
    for node in range(tree.num_nodes):
        want = hf_logits(hf_model, prefix + tree.path_tokens(node))[-1]
        torch.testing.assert_close(got[node], want, atol=atol, rtol=1e-4)


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
