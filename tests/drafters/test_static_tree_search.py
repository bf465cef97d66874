"""Static draft trees from the device-side search (the one CUDA graphs capture) against a plain reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree import DraftBudget, SamplingParams
from stree.drafter_service.drafters.mamba.drafter import MambaDrafter
from stree.protocols.token_tree import DraftMode


def reference_children(model, context, path_tokens, width):
    """Top-``width`` next tokens after ``context + path`` by a full forward pass (ties: lowest id first)."""
    logits = model.score_sequence(torch.tensor(context + path_tokens))[-1]
    return torch.topk(logits, width).indices.tolist()


@settings(max_examples=12, deadline=None)
@given(widths=st.lists(st.integers(1, 3), min_size=1, max_size=3), seed=st.integers(0, 50),
       max_nodes=st.integers(2, 40))
def test_greedy_static_tree_children_are_the_draft_models_top_k(models, widths, seed, max_nodes):
    draft = models["draft"]
    context = torch.randint(0, draft.vocab_size, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    spec = "chain:%d" % len(widths) if set(widths) == {1} else "static:" + ",".join(map(str, widths))
    session = MambaDrafter(draft, spec).open(context, SamplingParams())
    tree = session.draft(DraftBudget(max_nodes=max_nodes, max_depth=8, max_width=4))
    assert tree.num_nodes <= max_nodes and tree.tokens[0] == context[-1]
    kids = tree.children()
    for node in range(tree.num_nodes):
        depth = int(tree.depth[node])
        if depth == len(widths) or not kids[node]:
            continue
        path = [int(tree.tokens[i]) for i in tree.path(node)[1:]]
        want = reference_children(draft, context, path, widths[depth])
        got = [int(tree.tokens[c]) for c in kids[node]]
        assert got == want[: len(got)]
    # complete levels while the budget lasts: level sizes are W1, W1*W2, ...
    full, size = 1, 1
    for w in widths:
        size *= w
        full += size
    assert tree.num_nodes == min(full, max_nodes)


def test_sampled_static_tree_carries_draft_rows_and_is_seeded(models):
    draft = models["draft"]
    context = [5, 9, 2, 7]
    params = SamplingParams(temperature=1.0, top_k=5, seed=11)
    trees = [MambaDrafter(draft, "static:3,2").open(context, params).draft(DraftBudget(64, 8, 4)) for _ in range(2)]
    a, b = trees
    assert a.tokens.tolist() == b.tokens.tolist()  # the session's seed fixes the Gumbel noise
    assert a.mode is DraftMode.WITHOUT_REPLACEMENT
    kids = a.children()
    for node, ch in enumerate(kids):
        if ch:
            q = a.draft_probs[node]
            assert abs(float(q.sum()) - 1.0) < 1e-4 and int((q > 0).sum()) <= 5  # warped with top-k 5
            assert all(float(q[int(a.tokens[c])]) > 0 for c in ch)  # only tokens q can draw
            assert len({int(a.tokens[c]) for c in ch}) == len(ch)  # without replacement
