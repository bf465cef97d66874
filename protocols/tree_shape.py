"""Tree shape specs: ``chain:K``, ``static:3,1,1,1``, ``beam:DxM``, ``trie:DxW``, ``dynamic:N`` (and ``none``),
optionally filled by a named source (``lookup:chain:6``), and fusions of two sources
(``fused:beam:4x2+lookup:trie:6x3``).

A spec names how a drafter grows its tree each step; every shape is clipped to the step's ``DraftBudget``. Chain,
static, beam and trie shapes have a fixed node count laid out level by level (the root, then every node of depth 1,
then depth 2, ...), which makes them the engine's device templates: ``level_sizes``, ``num_nodes`` and, for
chain/static, ``static_parents``. A ``trie:DxW`` holds up to W continuations of D tokens merged where they share a
prefix: W nodes per level whose parents are chosen per step (a node that repeats an earlier branch is left invalid).

``source`` says which drafter of a composite fills the layout: ``""`` (the drafter's own, e.g. its draft model) or
``"lookup"`` (prompt lookup / retrieval). A ``fused`` shape is its parts' trees merged by prefix: the first part's
nodes, then the second part's nodes that are not already in the first (the rest left invalid), so its node count
and each node's depth are fixed while its parents are chosen per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

SHAPE_HELP = (
    "auto (the engine picks plain, chain or tree per step by measured goodput) | "
    "chain:K (K tokens, vanilla speculative decoding) | static:W1,W2,.. (top-W_d children at depth d) | "
    "beam:DxM (D steps of beam search with M beams, every beam token a node) | "
    "trie:DxW (up to W looked-up continuations of D tokens, merged by prefix) | "
    "dynamic:N (grow N nodes where the draft model is most confident) | "
    "lookup:SPEC (prompt lookup / retrieval fills SPEC) | fused:SPEC+lookup:SPEC (both trees merged by prefix)"
)
SOURCES = ("", "lookup")
"""Who fills a layout in a composite drafter: its own (draft model) or prompt lookup / retrieval."""
LOOKUP_KINDS = ("chain", "trie")
"""The layouts lookup drafters fill."""


@dataclass(frozen=True)
class TreeShape:
    kind: str  # none | chain | static | beam | trie | dynamic | fused | host
    widths: tuple[int, ...] = ()
    depth: int = 0
    beams: int = 0  # beam: beams per level; trie: branches (continuations) per level
    nodes: int = 0
    source: str = ""  # "" (the drafter's own) | "lookup"
    parts: tuple = ()  # fused: (the model part, the lookup part)

    # Shapes key the engine's graphs and goodput statistics, looked up several times per step: the hash and the
    # layout sizes are computed once per object (pickling rebuilds from the fields, so no cache crosses processes).
    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.kind, self.widths, self.depth, self.beams, self.nodes,
                                               self.source, self.parts))
        return h

    def __reduce__(self):
        return (type(self), (self.kind, self.widths, self.depth, self.beams, self.nodes, self.source, self.parts))

    @classmethod
    def parse(cls, spec: str) -> "TreeShape":
        """Parse a spec string; raises ValueError saying what is wrong."""
        if spec == "none":
            return cls("none")
        if not isinstance(spec, str) or ":" not in spec:
            raise ValueError(f"tree spec {spec!r} is not of the form KIND:ARGS; use {SHAPE_HELP}")
        kind, _, arg = spec.partition(":")
        if kind == "lookup":
            return cls.parse(arg).with_source("lookup")
        if kind == "fused":
            return cls.fused(*(cls.parse(part) for part in arg.split("+")))
        try:
            if kind == "chain":
                k = int(arg)
                if k < 1:
                    raise ValueError
                return cls("chain", widths=(1,) * k)
            if kind == "static":
                widths = tuple(int(w) for w in arg.split(","))
                if not widths or min(widths) < 1:
                    raise ValueError
                return cls("static", widths=widths)
            if kind in ("beam", "trie"):  # DEPTHxBEAMS, DEPTHxBRANCHES
                d, _, m = arg.lower().partition("x")
                depth, beams = int(d), int(m)
                if depth < 1 or beams < 1:
                    raise ValueError
                return cls(kind, depth=depth, beams=beams)
            if kind == "dynamic":
                n = int(arg)
                if n < 2:
                    raise ValueError
                return cls("dynamic", nodes=n)
        except ValueError:
            raise ValueError(f"tree spec {spec!r} has bad numbers; use {SHAPE_HELP}") from None
        raise ValueError(f"unknown tree kind {kind!r} in {spec!r}; use {SHAPE_HELP}")

    @classmethod
    def fused(cls, *parts: "TreeShape") -> "TreeShape":
        """The prefix merge of a draft model's tree (source ``""``) and a lookup tree (source ``"lookup"``), in
        that order."""
        if len(parts) != 2 or [p.source for p in parts] != ["", "lookup"]:
            raise ValueError(f"a fused tree merges a model tree and a lookup tree, as in "
                             f"fused:beam:4x2+lookup:trie:6x3; got {'+'.join(map(str, parts))!r}")
        if not all(p.kind in ("chain", "static", "beam", "trie") for p in parts):
            raise ValueError(f"a fused tree merges fixed layouts (chain, static, beam, trie); got "
                             f"{'+'.join(map(str, parts))!r}")
        return cls("fused", parts=tuple(parts))

    def with_source(self, source: str) -> "TreeShape":
        """This layout filled by ``source`` (a lookup shape is a chain or a trie)."""
        if source not in SOURCES:
            raise ValueError(f"unknown tree source {source!r}; use one of {SOURCES}")
        if source == "lookup" and self.kind not in LOOKUP_KINDS:
            raise ValueError(f"a lookup tree is chain:K or trie:DxW, not {self}")
        if self.source not in ("", source):
            raise ValueError(f"tree {self} already has source {self.source!r}")
        return TreeShape(self.kind, self.widths, self.depth, self.beams, self.nodes, source, self.parts)

    @property
    def layout(self) -> "TreeShape":
        """The same layout without its source (what the engine's layout constants depend on)."""
        if not self.source:
            return self
        return TreeShape(self.kind, self.widths, self.depth, self.beams, self.nodes)

    @classmethod
    def from_widths(cls, widths) -> "TreeShape":
        if isinstance(widths, str):
            return cls.parse("static:" + widths)
        return cls.parse("static:" + ",".join(str(int(w)) for w in widths))

    # ----- fixed-size layout (device templates) ----------------------------------------------
    @cached_property
    def level_sizes(self) -> tuple[int, ...]:
        """Nodes per depth, the root's level included: chain/static 1, W1, W1*W2, ...; beam 1, M, ..., M."""
        if self.kind == "none":
            return (1,)
        if self.kind in ("chain", "static"):
            sizes = [1]
            for w in self.widths:
                sizes.append(sizes[-1] * w)
            return tuple(sizes)
        if self.kind in ("beam", "trie"):
            return (1,) + (self.beams,) * self.depth
        raise ValueError(f"a {self.kind} tree has no level-by-level layout")

    @cached_property
    def num_nodes(self) -> int:
        """Nodes of the layout (the node budget for ``dynamic`` and padded ``host`` trees)."""
        if self.kind in ("dynamic", "host"):
            return self.nodes
        if self.kind == "fused":
            return 1 + sum(p.num_nodes - 1 for p in self.parts)
        return sum(self.level_sizes)

    @cached_property
    def max_depth(self) -> int:
        if self.kind == "fused":
            return max(p.max_depth for p in self.parts)
        return len(self.level_sizes) - 1

    @property
    def max_width(self) -> int:
        """Most children one node can have (a fused node: its own part's children and the other part's)."""
        if self.kind == "none":
            return 1
        if self.kind == "fused":
            return sum(p.max_width for p in self.parts)
        return max(self.widths) if self.kind in ("chain", "static") else self.beams

    def level_starts(self) -> list[int]:
        """Index of the first node of each depth."""
        starts, n = [], 0
        for size in self.level_sizes:
            starts.append(n)
            n += size
        return starts

    @property
    def is_chain(self) -> bool:
        """Whether the layout is one chain (``parents[i] = i - 1``), which tree kernels handle without a parent walk."""
        return self.kind in ("chain", "static") and all(w == 1 for w in self.widths)

    def static_parents(self) -> list[int]:
        """Parent of every node of a chain/static layout (children grouped by parent, in order)."""
        if self.kind not in ("chain", "static", "none"):
            raise ValueError(f"a {self.kind} tree has no static parents")
        parents, starts = [-1], self.level_starts()
        for d, w in enumerate(self.widths):
            parents += [starts[d] + j // w for j in range(self.level_sizes[d + 1])]
        return parents

    def depths(self) -> list[int]:
        """Depth of every node of the layout (a fused layout: the first part's nodes, then the second's)."""
        if self.kind == "fused":
            return self.parts[0].depths() + self.parts[1].depths()[1:]
        return [d for d, size in enumerate(self.level_sizes) for _ in range(size)]

    def __str__(self) -> str:
        if self.source:
            return f"{self.source}:{self.layout}"
        if self.kind == "fused":
            return "fused:" + "+".join(map(str, self.parts))
        if self.kind == "none":
            return "none"
        if self.kind == "chain":
            return f"chain:{len(self.widths)}"
        if self.kind == "static":
            return "static:" + ",".join(map(str, self.widths))
        if self.kind == "beam":
            return f"beam:{self.depth}x{self.beams}"
        if self.kind == "trie":
            return f"trie:{self.depth}x{self.beams}"
        return f"dynamic:{self.nodes}"
