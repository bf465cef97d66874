"""The tree shapes lookup drafters offer: one given shape, or ``auto`` (plain decoding, chains and tries, chosen
per step by goodput control). A shape without a source is taken as the lookup's (``chain:6`` is ``lookup:chain:6``).
"""

from __future__ import annotations

from typing import Union

from stree.protocols.tree_shape import TreeShape

LOOKUP_AUTO_SHAPES = tuple(TreeShape.parse(s) for s in (
    "none", "lookup:chain:2", "lookup:chain:4", "lookup:chain:6", "lookup:chain:8", "lookup:trie:4x3",
    "lookup:trie:8x4"))
"""``auto``: chains up to 8 tokens (a chain's steps measure every shorter one per depth) and two tries."""
DEFAULT_LOOKUP_TREE = "auto"


def lookup_shape(spec: Union[str, TreeShape]) -> TreeShape:
    """``spec`` as a lookup shape (a chain or a trie); a ValueError naming the spec otherwise."""
    shape = spec if isinstance(spec, TreeShape) else TreeShape.parse(spec)
    return shape if shape.source == "lookup" else shape.with_source("lookup")


def lookup_shapes(tree: Union[str, TreeShape, None]) -> list[TreeShape]:
    """The shapes a lookup drafter offers for ``tree`` (None: ``auto``)."""
    if tree is None or tree == "auto":
        return list(LOOKUP_AUTO_SHAPES)
    return [lookup_shape(tree)]
