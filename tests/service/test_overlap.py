"""Drafting ahead on the remote path (``RemoteDrafter(..., overlap=N)``), on loopback with a local Ray cluster.

The ``chain`` drafter gets the target checkpoint as its draft model (an oracle: its chains and its guess of the next
token are the target's own greedy tokens), so its hypotheses come true and hits happen; the ``mamba`` drafter gets
another random model, whose hypotheses do not. Either way greedy output equals plain greedy, also when the replica
holding the session (and its trees drafted ahead) is killed.
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

import stree  # noqa: E402
from service_helpers import drafter_service, stream_through_fault, wait_until  # noqa: E402
from stree.drafter_service.drafters.mamba.drafter import make_chain_drafter  # noqa: E402
from stree.proto.rpc import shared_loop  # noqa: E402
from stree.protocols import DraftBudget, SamplingParams  # noqa: E402
from stree.verifier.decode.loop import generate  # noqa: E402
from stree.verifier.model.checkpoint import init_model, load_model  # noqa: E402
from stree.verifier.service.remote_drafter import DraftUnavailable, RemoteDrafter  # noqa: E402
from stree.verifier.service.server import GenerationServer, RemoteDrafters, ServerLimits  # noqa: E402

BUDGET = DraftBudget(max_nodes=8, max_depth=4, max_width=2)
PROMPTS = [[5, 9, 13, 2, 7], [40], [33, 12, 60, 7, 7, 7, 21]]
N_NEW = 24
MAX_SEQ = 4096


class Stack:
    pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack()
    root = tmp_path_factory.mktemp("m")
    s.model_dir = init_model(root / "target", arch="mamba2", d_model=32, n_layer=2, vocab_size=64, seed=3)
    other = init_model(root / "other", arch="mamba2", d_model=32, n_layer=1, vocab_size=64, seed=8)
    s.model = load_model(s.model_dir)
    s.plain = [generate(s.model, p, drafter=None, max_new_tokens=N_NEW).token_ids for p in PROMPTS]
    options = {"chain": {"draft_model": str(s.model_dir), "num_speculative_tokens": 4},
               "mamba": {"draft_model": str(other), "tree": "beam:3x2"}}
    service = drafter_service(["chain", "mamba"], replicas=2, options_for=lambda name: options[name])
    s.drafters = service.__enter__()
    s.url = f"grpc://{s.drafters.address}"
    yield s
    service.__exit__(None, None, None)


def _plain(stack, prompt, n):
    return generate(stack.model, prompt, drafter=None, max_new_tokens=n).token_ids


def _oracle_trees(stack, prompt, steps):
    """The in-process chain oracle's tree after each of ``steps`` (lists of committed tokens)."""
    session = make_chain_drafter(draft_model=stack.model, num_speculative_tokens=4).open(prompt, SamplingParams())
    trees = [session.draft(BUDGET).tokens.tolist()]
    for step in steps:
        session.commit(step)
        trees.append(session.draft(BUDGET).tokens.tolist())
    return trees


def test_commit_of_a_hypothesis_takes_the_tree_drafted_ahead(stack):
    remote = RemoteDrafter(f"{stack.url}/chain", deadline_s=10.0, overlap=4)
    prompt, greedy = PROMPTS[0], _plain(stack, PROMPTS[0], 12)
    # the oracle's chain is greedy[:4]; its likeliest outcome: the chain accepted whole, then the target's next token
    hit_step, miss_step = greedy[:5], greedy[5:7]
    want = _oracle_trees(stack, prompt, [hit_step, miss_step])
    session = remote.open(prompt, SamplingParams(), budget=BUDGET)
    try:
        assert session.granted == 4
        assert session.draft(BUDGET).tokens.tolist() == want[0] == [prompt[-1]] + greedy[:4]
        assert wait_until(lambda: session.stats["ahead_trees"] >= 1, 30)
        session.commit(hit_step)
        assert session.stats["overlap_hits"] == 1
        assert session.draft(BUDGET).tokens.tolist() == want[1]  # taken at once, drafted from the hypothesis
        # a commit no hypothesis assumed (part of the chain, then the target's token): drafted as without overlap,
        # by the service's session that moved to the hypothesis on the hit
        assert wait_until(lambda: session.stats["ahead_trees"] >= 2, 30)
        session.commit(miss_step)
        assert session.stats["overlap_hits"] == 1 and session.stats["overlap_commits"] == 2
        assert session.draft(BUDGET).tokens.tolist() == want[2]
    finally:
        session.close()
        remote.close()
    assert remote.totals["overlap_hits"] == 1 and remote.totals["drafts"] == 3


def _generate_with_overlap(stack, name):
    """Greedy outputs of PROMPTS through ``name`` drafting 4 ahead, and the stats of its sessions summed."""
    remote = RemoteDrafter(f"{stack.url}/{name}", deadline_s=5.0, overlap=4)
    try:
        outs = [generate(stack.model, p, drafter=remote, max_new_tokens=N_NEW, budget=BUDGET) for p in PROMPTS]
    finally:
        remote.close()
    return outs, remote.totals


def test_greedy_with_overlap_equals_plain_and_hypotheses_come_true(stack):
    outs, totals = _generate_with_overlap(stack, "chain")
    assert [o.token_ids for o in outs] == stack.plain
    assert sum(o.stats["num_accepted_draft_tokens"] for o in outs) > N_NEW * len(PROMPTS) // 2
    assert totals["ahead_trees"] > 0 and totals["overlap_commits"] > 0
    # a tree drafted ahead always goes out before the answer to the Draft sent with its commit, so each true
    # hypothesis is taken, at the commit (a hit) or, when its tree came just after the commit, then (a late hit)
    assert totals["overlap_hits"] + totals["overlap_late_hits"] > 0


def test_hypotheses_that_miss_leave_greedy_output_unchanged(stack):
    outs, totals = _generate_with_overlap(stack, "mamba")
    assert [o.token_ids for o in outs] == stack.plain
    assert totals["ahead_trees"] > 0 and totals["overlap_commits"] > totals["overlap_hits"]


def test_replica_killed_with_trees_drafted_ahead(stack):
    remote = RemoteDrafter(f"{stack.url}/chain", deadline_s=2.0, overlap=4)
    pool = stack.drafters.host.pools["chain"]
    prompt, greedy = PROMPTS[2], _plain(stack, PROMPTS[2], 80)
    session = remote.open(prompt, SamplingParams(), budget=BUDGET)
    try:
        session.draft(BUDGET)
        assert wait_until(lambda: session.stats["ahead_trees"] >= 1, 30)
        holder = next(r for r in pool.replicas if r.sessions)
        ray.kill(holder.handle)  # for good: the pool replaces it, the service re-opens the session elsewhere
        session.commit(greedy[:5])  # the hypothesis drafted ahead on the killed replica comes true
        assert session.stats["overlap_hits"] == 1
        assert session.draft(BUDGET).tokens.tolist() == [greedy[4]] + greedy[5:9]  # the tree it drafted, kept
        done, trees = 5, 0
        while done < 75 and trees < 3:  # one token a step, as a verifier without drafts goes on
            try:
                tree = session.draft(BUDGET).tokens.tolist()
                assert tree == [greedy[done - 1]] + greedy[done:done + len(tree) - 1]
                trees += 1
            except DraftUnavailable:  # while the session is re-opened on the live replica
                time.sleep(0.1)
            session.commit([greedy[done]])
            done += 1
        assert trees == 3, "drafting should resume on the live replica"
    finally:
        session.close()
        remote.close()
    assert wait_until(lambda: not holder.replacing)


def test_replica_killed_mid_generation_with_overlap(stack):
    server = GenerationServer(stack.model, None, RemoteDrafters(f"{stack.url}/chain", 0.3, BUDGET, overlap=4),
                              limits=ServerLimits(max_sessions=2, max_seq_len=MAX_SEQ, budget=BUDGET))
    loop = shared_loop()
    loop.run(server.start())
    client = stree.Client(server.address, timeout=300)
    pool = stack.drafters.host.pools["chain"]
    killed = []

    def kill():
        killed.append(next(r for r in pool.replicas if r.sessions))
        ray.kill(killed[0].handle)  # for good, mid-generation, with the service drafting ahead

    try:
        tokens, _, recovered = stream_through_fault(client, PROMPTS[0], MAX_SEQ - 64, kill)
    finally:
        client.close()
        loop.run(server.stop(0), 30)
    assert recovered, "the session should move to the live replica and draft ahead again"
    assert tokens == _plain(stack, PROMPTS[0], len(tokens))
    assert wait_until(lambda: not killed[0].replacing)
