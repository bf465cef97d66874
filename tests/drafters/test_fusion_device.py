"""Fusion on the device: a model tree and a lookup tree merged by prefix inside the step, and the composite drafter's
shapes (the host ``merge_trees`` is the same union, pruned)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree import DraftBudget, create_drafter
from stree.drafter_service.drafters.fusion.device_fusion import FUSED_LOOKUP, composite_shapes, fuse_trees
from stree.drafter_service.drafters.fusion.fusion import merge_trees
from stree.drafter_service.drafters.lookup.device_tree import compact, lookup_trees
from stree.drafter_service.drafters.lookup.shapes import LOOKUP_AUTO_SHAPES
from stree.drafter_service.drafters.mamba.drafter import AUTO_SHAPES
from stree.drafter_service.drafters.retrieval.datastore import Datastore
from stree.protocols.token_tree import TokenTree
from stree.protocols.tree_shape import TreeShape


def _paths(tokens, parents, valid) -> set[tuple]:
    out = set()
    for i, ok in enumerate(valid):
        if ok:
            path, node = [], i
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            out.add(tuple(reversed(path)))
    return out


@st.composite
def beam_trees(draw, depth: int, beams: int, batch: int, vocab: int):
    """``[B, N]`` tokens and parents of beam layouts: each level's nodes pick parents on the level above, siblings
    distinct."""
    shape = TreeShape("beam", depth=depth, beams=beams)
    starts = shape.level_starts()
    tokens, parents = [], []
    for _ in range(batch):
        tok, par = [draw(st.integers(0, vocab - 1))], [-1]
        for d in range(depth):
            used = set()
            for _ in range(beams):
                above = draw(st.integers(starts[d], starts[d] + shape.level_sizes[d] - 1))
                free = [t for t in range(vocab) if (above, t) not in used]
                t = draw(st.sampled_from(free)) if free else 0
                used.add((above, t))
                tok.append(t)
                par.append(above)
        tokens.append(tok)
        parents.append(par)
    return shape, torch.tensor(tokens), torch.tensor(parents)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), model_depth=st.integers(1, 3), beams=st.integers(1, 3),
       branches=st.integers(1, 3), lookup_depth=st.integers(1, 4))
def test_fused_tree_is_the_prefix_union(data, batch, model_depth, beams, branches, lookup_depth):
    vocab = 3
    model_shape, m_tok, m_par = data.draw(beam_trees(model_depth, beams, batch, vocab))
    k = branches + 1
    rows = torch.tensor(data.draw(st.lists(st.lists(st.lists(st.integers(0, vocab - 1), min_size=lookup_depth,
                                                              max_size=lookup_depth), min_size=k, max_size=k),
                                           min_size=batch, max_size=batch)))
    lengths = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, lookup_depth), min_size=k, max_size=k),
                                              min_size=batch, max_size=batch)))
    lookup_shape = TreeShape.parse(f"lookup:chain:{lookup_depth}" if branches == 1
                                   else f"lookup:trie:{lookup_depth}x{branches}")
    l_tok, l_par, l_valid = lookup_trees(m_tok[:, 0], rows, lengths, torch.zeros_like(lengths), branches,
                                         lookup_depth)
    tokens, parents, valid = fuse_trees(m_tok, m_par, l_tok, l_par, l_valid, lookup_shape)
    fused = TreeShape.fused(model_shape, lookup_shape)
    assert tokens.shape == (batch, fused.num_nodes)
    depth = fused.depths()
    for b in range(batch):
        tok, par, ok = tokens[b].tolist(), parents[b].tolist(), valid[b].tolist()
        model_paths = _paths(m_tok[b].tolist(), m_par[b].tolist(), [True] * m_tok.shape[1])
        lookup_paths = _paths(l_tok[b].tolist(), l_par[b].tolist(), l_valid[b].tolist())
        assert _paths(tok, par, ok) == model_paths | lookup_paths
        assert len(_paths(tok, par, ok)) == sum(ok)  # no node twice: no duplicate siblings
        for i in range(1, len(tok)):
            assert 0 <= par[i] < i and depth[i] == depth[par[i]] + 1
            assert not ok[i] or ok[par[i]]  # no valid node below an invalid one
        # the host merge of the same two trees keeps the same paths when nothing is pruned
        host = [TokenTree.from_parents(*compact(m_tok[b:b + 1], m_par[b:b + 1], torch.ones_like(m_tok[b:b + 1],
                                                                                                  dtype=torch.bool))[0]),
                TokenTree.from_parents(*compact(l_tok[b:b + 1], l_par[b:b + 1], l_valid[b:b + 1])[0])]
        merged = merge_trees(host, DraftBudget(max_nodes=64, max_depth=8, max_width=8))
        assert {tuple(merged.path_tokens(i)) for i in range(merged.num_nodes)} == _paths(tok, par, ok)


def test_composite_shapes():
    auto = composite_shapes(list(AUTO_SHAPES), list(LOOKUP_AUTO_SHAPES))
    assert auto[0].kind == "none" and len(auto) == len(set(auto))
    assert {str(s) for s in auto if s.kind == "fused"} == {"fused:beam:4x2+lookup:chain:6",
                                                           "fused:beam:5x3+lookup:trie:4x3"}
    assert set(AUTO_SHAPES) | set(LOOKUP_AUTO_SHAPES) <= set(auto)
    beam = TreeShape.parse("beam:4x3")
    assert composite_shapes([beam], list(LOOKUP_AUTO_SHAPES)) == [TreeShape.fused(beam, FUSED_LOOKUP)]
    chain = TreeShape.parse("lookup:chain:5")
    assert composite_shapes([beam], [chain]) == [TreeShape.fused(beam, chain)]
    assert composite_shapes([TreeShape.parse("static:3,1")], list(LOOKUP_AUTO_SHAPES)) == []  # sampled children


def test_fusion_drafter_fuses_on_the_device_only_a_model_beside_a_lookup(models):
    draft = models["draft"]
    offer = create_drafter("fusion:mamba+ngram", draft_model=draft, tree="beam:3x2").device_drafter()
    assert [str(s) for s in offer.shapes] == ["fused:beam:3x2+lookup:trie:4x3"]
    auto = create_drafter("fusion:ngram+mamba", draft_model=draft, tree="auto").device_drafter()
    assert auto.shapes[0].kind == "none" and any(s.kind == "fused" for s in auto.shapes)
    store = Datastore.build([[1, 2, 3]], vocab_size=64)
    assert create_drafter("fusion:ngram+retrieval", datastore=store).device_drafter() is None  # two lookups: host
    assert create_drafter("fusion:mamba+ngram", draft_model=draft, tree="chain:3").device_drafter() is None


def test_tree_shape_specs():
    for spec in ("lookup:chain:6", "lookup:trie:4x3", "trie:2x5", "fused:beam:4x2+lookup:trie:6x3",
                 "fused:beam:2x1+lookup:chain:3", "chain:4", "static:3,1,1", "beam:4x3", "none", "dynamic:8"):
        assert str(TreeShape.parse(spec)) == spec
    fused = TreeShape.parse("fused:beam:4x2+lookup:trie:6x3")
    assert fused.num_nodes == 9 + 18 and fused.max_depth == 6 and fused.max_width == 5 and not fused.is_chain
    assert fused.depths() == [0, 1, 1, 2, 2, 3, 3, 4, 4] + [d for d in range(1, 7) for _ in range(3)]
    trie = TreeShape.parse("lookup:trie:3x2")
    assert trie.level_sizes == (1, 2, 2, 2) and trie.layout == TreeShape.parse("trie:3x2") and trie != trie.layout
    assert TreeShape.parse("lookup:chain:3").is_chain
    for bad, match in (("lookup:beam:3x2", "lookup tree is chain:K or trie:DxW"),
                       ("fused:beam:2x2+beam:3x3", "merges a model tree and a lookup tree"),
                       ("fused:lookup:chain:2+beam:2x2", "merges a model tree and a lookup tree"),
                       ("trie:0x2", "bad numbers"), ("lookup:trie:2", "bad numbers")):
        with pytest.raises(ValueError, match=match):
            TreeShape.parse(bad)
