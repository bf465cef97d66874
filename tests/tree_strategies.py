"""Hypothesis strategies for random token trees: chains, stars, deep and bushy shapes."""

from __future__ import annotations

from hypothesis import strategies as st

from stree.protocols.token_tree import TokenTree


@st.composite
def parent_lists(draw, max_nodes: int = 24):
    """Parent arrays of random shape (``parents[0] == -1``, ``parents[i] < i``)."""
    n = draw(st.integers(1, max_nodes))
    shape = draw(st.sampled_from(["chain", "star", "deep", "bushy", "random"]))
    parents = [-1]
    for i in range(1, n):
        if shape == "chain":
            p = i - 1
        elif shape == "star":
            p = 0
        elif shape == "deep":
            p = draw(st.integers(max(0, i - 2), i - 1))
        elif shape == "bushy":
            p = draw(st.integers(0, max(0, (i - 1) // 3)))
        else:
            p = draw(st.integers(0, i - 1))
        parents.append(p)
    return parents


@st.composite
def token_trees(draw, vocab_size: int, max_nodes: int = 24):
    parents = draw(parent_lists(max_nodes))
    tokens = draw(st.lists(st.integers(0, vocab_size - 1), min_size=len(parents), max_size=len(parents)))
    return TokenTree.from_parents(tokens, parents)
