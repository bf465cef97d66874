"""Incremental detokenizing with stop strings, shared by the gRPC and HTTP front ends."""

from __future__ import annotations


class TextStream:
    """Incremental detokenizing with stop strings: emits only text that can no longer change or be cut."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.sent = 0
        self.text = ""
        self.stopped = False

    def update(self, ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(ids)
        for stop in self.stops:
            at = full.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                full, self.stopped, final = full[:at], True, True
        end = len(full)
        if not final:
            end = len(full.rstrip("\ufffd"))  # an incomplete multi-byte character
            for stop in self.stops:  # a tail that may still grow into a stop string
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if full[:end].endswith(stop[:k]):
                        end -= k
                        break
        end = max(end, self.sent)
        delta = full[self.sent:end]
        self.sent, self.text = end, full[:end]
        return delta

    def tokens_through_stop(self, ids: list[int]) -> list[int]:
        """The shortest prefix of ``ids`` whose text reaches a stop string."""
        for k in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:k])
            if any(s in text for s in self.stops):
                return ids[:k]
        return ids
