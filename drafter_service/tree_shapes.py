"""Tree shape specs for model drafters: ``chain:K``, ``static:3,1,1,1``, ``beam:DxM``, ``dynamic:N``.

A spec names how a draft model grows its tree each step; every shape is clipped to the step's
``DraftBudget``.
"""

from __future__ import annotations

from dataclasses import dataclass

SHAPE_HELP = (
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

    @classmethod
    def parse(cls, spec: str) -> "TreeShape":
        """Parse a spec string; raises ValueError saying what is wrong."""
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

    def __str__(self) -> str:
        if self.kind == "chain":
            return f"chain:{len(self.widths)}"
        if self.kind == "static":
            return "static:" + ",".join(map(str, self.widths))
        if self.kind == "beam":
            return f"beam:{self.depth}x{self.beams}"
        return f"dynamic:{self.nodes}"
