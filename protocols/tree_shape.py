"""Tree shape specs: ``chain:K``, ``static:3,1,1,1``, ``beam:DxM``, ``dynamic:N`` (and ``none``).

A spec names how a draft model grows its tree each step; every shape is clipped to the step's
``DraftBudget``. Chain, static and beam shapes have a fixed node count laid out level by level
(the root, then every node of depth 1, then depth 2, ...), which makes them the engine's device
templates: ``level_sizes``, ``num_nodes`` and, for chain/static, ``static_parents``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

SHAPE_HELP = (
    "auto (the engine picks plain, chain or tree per step by measured goodput) | "
    "chain:K (K tokens, vanilla speculative decoding) | static:W1,W2,.. (top-W_d children at depth d) | "
    "beam:DxM (D steps of beam search with M beams, every beam token a node) | "
    "dynamic:N (grow N nodes where the draft model is most confident)"
)


@dataclass(frozen=True)
class TreeShape:
    kind: str  # chain | static | beam | dynamic
    widths: tuple[int, ...] = ()
    depth: int = 0
    beams: int = 0
    nodes: int = 0

    # Shapes key the engine's graphs and goodput statistics, looked up several times per step: the hash and the
    # layout sizes are computed once per object (pickling rebuilds from the fields, so no cache crosses processes).
    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.kind, self.widths, self.depth, self.beams, self.nodes))
        return h

    def __reduce__(self):
        return (type(self), (self.kind, self.widths, self.depth, self.beams, self.nodes))

    @classmethod
    def parse(cls, spec: str) -> "TreeShape":
        """Parse a spec string; raises ValueError saying what is wrong."""
        if spec == "none":
            return cls("none")
        if not isinstance(spec, str) or ":" not in spec:
            raise ValueError(f"tree spec {spec!r} is not of the form KIND:ARGS; use {SHAPE_HELP}")
        kind, _, arg = spec.partition(":")
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
            if kind == "beam":
                d, _, m = arg.lower().partition("x")
                depth, beams = int(d), int(m)
                if depth < 1 or beams < 1:
                    raise ValueError
                return cls("beam", depth=depth, beams=beams)
            if kind == "dynamic":
                n = int(arg)
                if n < 2:
                    raise ValueError
                return cls("dynamic", nodes=n)
        except ValueError:
            raise ValueError(f"tree spec {spec!r} has bad numbers; use {SHAPE_HELP}") from None
        raise ValueError(f"unknown tree kind {kind!r} in {spec!r}; use {SHAPE_HELP}")

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
        if self.kind == "beam":
            return (1,) + (self.beams,) * self.depth
        raise ValueError(f"a {self.kind} tree has no fixed layout")

    @cached_property
    def num_nodes(self) -> int:
        """Nodes of the layout (the node budget for ``dynamic`` and padded ``host`` trees)."""
        if self.kind in ("dynamic", "host"):
            return self.nodes
        return sum(self.level_sizes)

    @cached_property
    def max_depth(self) -> int:
        return len(self.level_sizes) - 1

    @property
    def max_width(self) -> int:
        """Most children one node can have."""
        if self.kind == "none":
            return 1
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
        return [d for d, size in enumerate(self.level_sizes) for _ in range(size)]

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "chain":
            return f"chain:{len(self.widths)}"
        if self.kind == "static":
            return "static:" + ",".join(map(str, self.widths))
        if self.kind == "beam":
            return f"beam:{self.depth}x{self.beams}"
        return f"dynamic:{self.nodes}"
