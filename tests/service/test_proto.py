"""The stree.v1 protobuf package: checked-in stubs are fresh, and trees/params cross the wire intact."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from stree.proto import codec as wire
from stree.proto.stree.v1 import common_pb2, drafter_pb2, generation_pb2, generation_pb2_grpc, drafter_pb2_grpc
from stree.protocols import DraftBudget, DraftMode, SamplingParams, TokenTree

REPO = Path(__file__).resolve().parents[2]


def _load_generate_script():
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_stubs_match_a_fresh_generation():
    gen = _load_generate_script()
    assert gen.stale_files() == [], "run `python proto/generate.py` and check the stubs in"


def test_generated_modules_import_under_the_stree_package(tmp_path):
    gen = _load_generate_script()
    written = gen.generate(tmp_path)
    names = {p.name for p in written}
    assert {"drafter_pb2.py", "drafter_pb2_grpc.py", "generation_pb2.py", "common_pb2.py"} <= names
    for path in written:
        text = path.read_text()
        assert "from stree.v1 import" not in text
    assert hasattr(drafter_pb2_grpc, "DrafterServiceStub")
    assert hasattr(generation_pb2_grpc, "GenerationServiceServicer")
    services = generation_pb2.DESCRIPTOR.services_by_name
    assert set(services["GenerationService"].methods_by_name) == {"Generate", "GenerateUnary"}
    assert drafter_pb2.DESCRIPTOR.package == "stree.v1"


def _random_tree(gen: torch.Generator, n: int, vocab: int, with_probs: bool) -> TokenTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    probs = None
    mode = DraftMode.DETERMINISTIC
    if with_probs:
        probs = torch.softmax(torch.randn(n, vocab, generator=gen), -1)
        mode = DraftMode.WITHOUT_REPLACEMENT
    return TokenTree(tokens, parents, probs, mode)


@pytest.mark.parametrize("with_probs", [False, True])
def test_tree_round_trip(with_probs):
    gen = torch.Generator().manual_seed(7 + with_probs)
    for n in (1, 2, 9, 40):
        tree = _random_tree(gen, n, vocab=50, with_probs=with_probs)
        msg = wire.tree_to_pb(tree, request_id=3, context_length=11, seconds=0.5)
        msg = drafter_pb2.DraftTree.FromString(msg.SerializeToString())
        assert (msg.request_id, msg.context_length) == (3, 11)
        back = wire.tree_from_pb(msg)
        assert torch.equal(back.tokens, tree.tokens)
        assert torch.equal(back.parents, tree.parents)
        assert back.mode == tree.mode
        if with_probs:
            assert msg.vocab_size == 50 and len(msg.draft_probs) == n * 50 * 4
            assert torch.equal(back.draft_probs, tree.draft_probs.float())
        else:
            assert back.draft_probs is None and msg.draft_probs == b""


def _msg(**kw):
    base = dict(tokens=[4, 5, 6], parents=[-1, 0, 1])
    base.update(kw)
    return drafter_pb2.DraftTree(**base)


@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(tokens=[], parents=[]), "no nodes"),
        (dict(parents=[-1, 0]), "3 tokens but 2 parents"),
        (dict(parents=[-1, 2, 1]), "parent"),
        (dict(parents=[0, 0, 1]), "root"),
        (dict(draft_probs=b"\x00" * 12, vocab_size=0), "vocab_size is 0"),
        (dict(draft_probs=b"\x00" * 12, vocab_size=8), "bytes"),
        (dict(draft_probs=np.full((3, 8), -1.0, "<f4").tobytes(), vocab_size=8), "negative"),
        (dict(draft_probs=np.full((3, 8), np.nan, "<f4").tobytes(), vocab_size=8), "non-finite"),
        (dict(draft_probs=np.full((3, 4), 0.25, "<f4").tobytes(), vocab_size=4), "outside"),
        (dict(mode=drafter_pb2.DRAFT_MODE_IID), "needs draft_probs"),
    ],
)
def test_malformed_wire_trees_raise_value_error(fields, needle):
    with pytest.raises(ValueError, match=needle):
        wire.tree_from_pb(_msg(**fields))


def test_sampling_and_budget_conversions():
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=123)
    assert wire.sampling_from_pb(wire.sampling_to_pb(p)) == p
    # Unset top_p and seed mean "disabled" and "pick one"; an explicit zero top_p is refused.
    assert wire.sampling_from_pb(common_pb2.SamplingParams()) == SamplingParams()
    with pytest.raises(ValueError, match="top_p"):
        wire.sampling_from_pb(common_pb2.SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="temperature"):
        wire.sampling_from_pb(common_pb2.SamplingParams(temperature=-1.0))
    default = DraftBudget(16, 8, 4)
    assert wire.budget_from_pb(common_pb2.DraftBudget(max_depth=3), default) == DraftBudget(16, 3, 4)
    assert wire.budget_from_pb(wire.budget_to_pb(DraftBudget(5, 2, 2)), default) == DraftBudget(5, 2, 2)
    with pytest.raises(ValueError, match="max_nodes"):
        wire.budget_from_pb(common_pb2.DraftBudget(max_nodes=5000), default)


def test_codec_refuses_ids_that_do_not_fit_the_wire():
    with pytest.raises(ValueError, match="uint32"):
        wire.tree_to_pb(TokenTree.chain([1, 2**33]), 1, 1, 0.0)
