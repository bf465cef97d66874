"""A tiny third-party drafter plugin for stree: drafts the last context token repeated ``length`` times.

Installed as a separate package, it reaches stree only through the ``stree.drafters`` entry point.
"""

from stree.protocols import ContextSession, DraftBudget, HostDrafter, TokenTree


class EchoSession(ContextSession):
    def __init__(self, prompt_ids, params, length):
        super().__init__(prompt_ids, params)
        self.length = length

    def draft(self, budget: DraftBudget) -> TokenTree:
        n = min(self.length, budget.max_depth, budget.max_nodes - 1)
        return TokenTree.chain([self.context[-1]] * (n + 1))


class EchoDrafter(HostDrafter):
    name = "echo"

    def __init__(self, length=4):
        if int(length) < 0:
            raise ValueError(f"echo drafter: length must be >= 0, got {length}")
        self.length = int(length)

    def open(self, prompt_ids, params):
        return EchoSession(prompt_ids, params, self.length)


def make_drafter(**options):
    """Entry point ``echo``: options are EchoDrafter's (``length``)."""
    return EchoDrafter(**options)
