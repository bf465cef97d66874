"""Checks every drafted tree must pass, a commit-then-draft loop that applies them, and a Hypothesis
strategy for draft budgets."""

from __future__ import annotations

from hypothesis import strategies as st

from stree.protocols import DraftBudget, DraftMode, TokenTree


def budgets(max_nodes: int = 24, max_depth: int = 8, max_width: int = 4):
    return st.builds(
        DraftBudget,
        max_nodes=st.integers(1, max_nodes),
        max_depth=st.integers(0, max_depth),
        max_width=st.integers(1, max_width),
    )


def assert_valid_draft(tree: TokenTree, context: list[int], budget: DraftBudget) -> None:
    """A deterministic tree rooted at the last context token, within budget, no duplicate siblings."""
    assert isinstance(tree, TokenTree)
    assert budget.violation(tree) is None, budget.violation(tree)
    assert int(tree.tokens[0]) == context[-1]
    assert tree.mode is DraftMode.DETERMINISTIC and tree.draft_probs is None
    tokens = tree.tokens.tolist()
    for kids in tree.children():
        sibling_tokens = [tokens[k] for k in kids]
        assert len(sibling_tokens) == len(set(sibling_tokens)), f"duplicate siblings in {tree}"
    depth = tree.depth.tolist()
    assert depth == sorted(depth), "nodes must come in breadth-first order"


def drafts_after_commits(session, prompt: list[int], steps: list[list[int]], budget: DraftBudget):
    """Commit nothing, then each of ``steps``, to ``session`` (opened on ``prompt``), drafting under ``budget``
    after each commit; yields every (valid) draft with the context it was drafted on, then closes the session."""
    context = list(prompt)
    for step in [[]] + steps:
        session.commit(step)
        context += step
        tree = session.draft(budget)
        assert_valid_draft(tree, context, budget)
        yield tree, context
    session.close()


def occurs_in(needle: list[int], haystack: list[int], before: int | None = None) -> bool:
    """Whether ``needle`` is a contiguous run of ``haystack`` starting before index ``before``."""
    last_start = len(haystack) - len(needle) if before is None else min(before - 1, len(haystack) - len(needle))
    return any(haystack[s : s + len(needle)] == needle for s in range(0, last_start + 1))
