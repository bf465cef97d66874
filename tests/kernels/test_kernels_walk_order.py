"""The exact tree walk visits a tree's nodes in depth-first preorder (``ssm_walk_triton.preorder``, computed in
registers from the parents), so that most nodes cost one decode step: checked against a Python preorder on random
trees, padded batches and the shapes the engine drafts, plus the steps it saves over node order."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from stree.kernels.ssm_walk_triton import preorder  # noqa: E402


@triton.jit
def _preorder_kernel(par_ptr, out_ptr, N, NP: tl.constexpr):
    idx = tl.arange(0, NP)
    ok = idx < N
    par = tl.load(par_ptr + idx, mask=ok, other=-1).to(tl.int32)
    tl.store(out_ptr + idx, preorder(par, ok, idx, N), mask=ok)


def preorder_of(parents: list[int]) -> list[int]:
    """The kernel's preorder of one tree."""
    n = len(parents)
    out = torch.full((n,), -7, dtype=torch.int32)
    _preorder_kernel[(1,)](torch.tensor(parents, dtype=torch.int32), out, n, NP=max(2, triton.next_power_of_2(n)))
    return out.tolist()


def python_preorder(parents: list[int]) -> list[int]:
    children: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    roots = [i for i, p in enumerate(parents) if p < 0]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    out, stack = [], list(reversed(roots))
    while stack:
        v = stack.pop()
        out.append(v)
        stack.extend(reversed(children[v]))
    return out


def walk_steps(parents: list[int], order: list[int]) -> int:
    """Decode steps the walk takes in ``order``, holding the previous node's state and its parent's."""
    cur = sib = -1
    total = 0
    for i in order:
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        held = [k for k, v in enumerate(path) if v in (cur, sib)]
        total += min(held) if held else len(path)
        cur, sib = i, parents[i]
    return total


ENGINE_SHAPES = {
    "chain": list(range(-1, 15)),
    "binary": [-1] + [(i - 1) // 2 for i in range(1, 31)],
    "beam 4x3, level by level": [-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    "static 3,1,1,1": [-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    "star": [-1] + [0] * 8,
    "bushy": [-1, 0, 1, 1, 0, 4, 2, 6, 5, 3, 9, 9],
    "padded (parent 0 after the real nodes)": [-1, 0, 1, 1, 2, 0, 0, 0],
}


@pytest.mark.parametrize("name", list(ENGINE_SHAPES))
def test_engine_shapes_are_walked_in_preorder(name):
    parents = ENGINE_SHAPES[name]
    assert preorder_of(parents) == python_preorder(parents)


def test_random_trees_are_walked_in_preorder():
    rng = random.Random(torch.initial_seed())
    for _ in range(12):
        n = rng.randint(1, 40)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        assert preorder_of(parents) == python_preorder(parents), parents


def test_preorder_saves_steps_on_level_ordered_trees_and_costs_chains_nothing():
    steps = {name: (walk_steps(p, python_preorder(p)), walk_steps(p, list(range(len(p)))))
             for name, p in ENGINE_SHAPES.items()}  # (preorder, node order)
    assert steps["binary"] == (48, 78)
    assert steps["beam 4x3, level by level"] == (15, 39)
    assert steps["bushy"] == (15, 22)
    assert steps["chain"] == (16, 16) and steps["star"] == (9, 9)
    assert sum(dfs for dfs, _ in steps.values()) < sum(node for _, node in steps.values())
