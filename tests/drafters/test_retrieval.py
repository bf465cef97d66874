"""Retrieval drafter and its datastore: suffix array, lookups, save/load, the CLI, bad files."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import tqdm.std
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stree import DraftBudget, SamplingParams, create_drafter
from stree.cli import main as stree_main
from stree.drafter_service.drafters.retrieval.datastore import Datastore, build_suffix_array
from stree.drafter_service.drafters.retrieval.drafter import RetrievalDrafter
from drafter_checks import assert_valid_draft, budgets, occurs_in

GREEDY = SamplingParams()


# ----- a real corpus: a docstring-rich module from site-packages, and a BPE trained on it ----------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(corpus file, model dir with tokenizer.json, corpus text)."""
    root = tmp_path_factory.mktemp("retrieval")
    text = open(inspect.getsourcefile(tqdm.std), encoding="utf-8").read()[:12000]
    corpus_file = root / "corpus.txt"
    corpus_file.write_text(text, encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    model_dir = root / "model"
    model_dir.mkdir()
    tok.save(str(model_dir / "tokenizer.json"))
    return corpus_file, model_dir, text


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory):
    corpus_file, model_dir, _ = corpus
    out = tmp_path_factory.mktemp("ds") / "store"
    rc = stree_main(["datastore", "build", str(corpus_file), "--tokenizer", str(model_dir), "--out", str(out),
                     "--quiet"])
    assert rc == 0
    return out


def test_cli_builds_saves_and_reloads_a_real_corpus(corpus, built, capsys):
    _, model_dir, text = corpus
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    store = Datastore.load(built, vocab_size=tok.get_vocab_size())
    assert store.vocab_size == tok.get_vocab_size()
    assert store.num_sequences == 1
    corpus_ids = np.asarray(store.tokens[:-1]).tolist()
    assert tok.decode(corpus_ids) == text
    assert stree_main(["datastore", "info", str(built), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "stree-datastore" and info["version"] == 1
    assert info["num_corpus_tokens"] == len(corpus_ids)


def test_drafts_the_continuation_found_in_the_corpus(corpus, built):
    _, model_dir, text = corpus
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    store = Datastore.load(built)
    ids = np.asarray(store.tokens[:-1]).tolist()
    # A context whose last 16 tokens occur once in the corpus: the draft must be what followed it.
    pos = next(p for p in range(len(ids) // 2, len(ids) - 8) if store.count(ids[p - 16 : p]) == 1)
    context = ids[pos - 24 : pos]
    drafter = create_drafter("retrieval", datastore=str(built))
    budget = DraftBudget(max_nodes=16, max_depth=6, max_width=2)
    tree = drafter.open(context, GREEDY).draft(budget)
    assert_valid_draft(tree, context, budget)
    assert tree.to_sequences() == [ids[pos : pos + 6]]
    assert tok.decode(context[-8:] + tree.to_sequences()[0]) in text


def test_most_frequent_continuation_wins():
    corpus = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [7, 1, 2, 3, 9]]
    drafter = RetrievalDrafter(Datastore.build(corpus, vocab_size=10))
    chain = drafter.open([8, 1, 2], GREEDY).draft(DraftBudget(max_nodes=8, max_depth=3, max_width=1))
    assert chain.tokens.tolist() == [2, 3, 4]  # "3 4" twice beats "3 9" once; the document ends after 4
    full = drafter.open([8, 1, 2], GREEDY).draft(DraftBudget(max_nodes=8, max_depth=3, max_width=3))
    assert sorted(full.to_sequences()) == [[3, 4], [3, 9], [5, 6]]
    # Longest suffix wins: "7 1 2" occurs once, followed by "3 9".
    longest = drafter.open([7, 1, 2], GREEDY).draft(DraftBudget(max_nodes=8, max_depth=3, max_width=3))
    assert longest.to_sequences() == [[3, 9]]


def test_no_match_and_one_token_contexts():
    drafter = RetrievalDrafter(Datastore.build([[1, 2, 3]], vocab_size=5), min_suffix=1)
    assert drafter.open([4], GREEDY).draft(DraftBudget()).tokens.tolist() == [4]
    assert drafter.open([2], GREEDY).draft(DraftBudget()).tokens.tolist() == [2, 3]
    assert drafter.open([3], GREEDY).draft(DraftBudget()).tokens.tolist() == [3]  # document ends
    with pytest.raises(ValueError, match="non-empty"):
        drafter.open([], GREEDY)


def test_occurrence_cap_still_finds_continuations():
    corpus = [[1, k % 7 + 2] for k in range(200)]
    drafter = RetrievalDrafter(Datastore.build(corpus, vocab_size=10), max_occurrences=10)
    tree = drafter.open([1], GREEDY).draft(DraftBudget(max_nodes=16, max_depth=1, max_width=8))
    assert 1 < tree.num_nodes <= 8
    assert set(tree.tokens.tolist()[1:]) <= set(range(2, 9))


@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.integers(-1, 3), min_size=1, max_size=60))
def test_suffix_array_matches_sorting_suffixes(text):
    arr = np.asarray(text)
    assert build_suffix_array(arr).tolist() == sorted(range(len(text)), key=lambda i: text[i:])


docs = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=12), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(corpus=docs, context=st.lists(st.integers(0, 5), min_size=1, max_size=20), budget=budgets(),
       max_suffix=st.integers(1, 6))
def test_property_drafts_are_valid_corpus_continuations(corpus, context, budget, max_suffix):
    if not any(corpus):
        corpus = corpus + [[0]]
    store = Datastore.build(corpus, vocab_size=6)
    # find() counts occurrences exactly as a brute-force scan does.
    for m in range(1, min(len(context), max_suffix) + 1):
        expected = sum(occurs_in(context[-m:], doc[s:], before=1) for doc in corpus for s in range(len(doc)))
        assert store.count(context[-m:]) == expected
    session = RetrievalDrafter(store, max_suffix=max_suffix).open(context, GREEDY)
    tree = session.draft(budget)
    assert_valid_draft(tree, context, budget)
    for node in range(1, tree.num_nodes):
        assert any(occurs_in(tree.path_tokens(node), doc) for doc in corpus)
    session.commit([context[0]])
    assert_valid_draft(session.draft(budget), context + [context[0]], budget)


def test_save_load_roundtrip(tmp_path):
    store = Datastore.build([[1, 2, 3], [2, 3, 4]], vocab_size=5, meta={"note": "x"})
    store.save(tmp_path / "ds")
    again = Datastore.load(tmp_path / "ds")
    assert np.asarray(again.tokens).tolist() == np.asarray(store.tokens).tolist()
    assert np.asarray(again.suffix_array).tolist() == np.asarray(store.suffix_array).tolist()
    assert again.meta == {"note": "x"} and again.num_sequences == 2


# ----- bad input -----------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ds"
    Datastore.build([[1, 2, 3, 1, 2]], vocab_size=5).save(path)
    return path


def test_missing_datastore_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Datastore.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_drafter("retrieval", datastore=str(tmp_path / "nowhere"))
    assert stree_main(["datastore", "info", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_missing_files_are_named(saved):
    (saved / "suffix_array.npy").unlink()
    with pytest.raises(FileNotFoundError, match="suffix_array.npy"):
        Datastore.load(saved)
    (saved / "header.json").unlink()
    with pytest.raises(FileNotFoundError, match="header.json"):
        Datastore.load(saved)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "header.json").write_text("{not json"), "header.json: not valid JSON"),
        (lambda d: (d / "header.json").write_text(json.dumps({"format": "other"})), "header.json: not a stree-datastore"),
        (lambda d: _edit_header(d, version=99), "version 99 is not supported"),
        (lambda d: _edit_header(d, vocab_size="big"), "vocab_size"),
        (lambda d: _edit_header(d, vocab_size=3), "tokens.npy: token ids outside"),
        (lambda d: (d / "tokens.npy").write_bytes(b"garbage"), "tokens.npy: not a readable"),
        (lambda d: np.save(d / "tokens.npy", np.zeros((2, 2), dtype=np.int32)), "tokens.npy: expected a 1-D"),
        (lambda d: np.save(d / "tokens.npy", np.zeros(3, dtype=np.int32)), "tokens.npy: holds"),
        (lambda d: np.save(d / "suffix_array.npy", np.arange(4)), "suffix_array.npy: has shape"),
        (lambda d: np.save(d / "suffix_array.npy", np.arange(6) + 5), "suffix_array.npy: positions outside"),
    ],
)
def test_corrupt_or_mismatched_files_are_named(saved, damage, match):
    damage(saved)
    with pytest.raises(ValueError, match=match):
        Datastore.load(saved)


def _edit_header(path, **fields):
    header = json.loads((path / "header.json").read_text())
    header.update(fields)
    (path / "header.json").write_text(json.dumps(header))


def test_vocab_mismatch_and_bad_options(saved, tmp_path):
    with pytest.raises(ValueError, match="different tokenizer"):
        RetrievalDrafter(str(saved), vocab_size=4)
    with pytest.raises(ValueError, match="min_suffix"):
        RetrievalDrafter(str(saved), min_suffix=0)
    with pytest.raises(ValueError, match="a path or a Datastore"):
        RetrievalDrafter(42)
    with pytest.raises(ValueError, match="outside"):
        Datastore.build([[1, 7]], vocab_size=5)
    with pytest.raises(ValueError, match="no tokens"):
        Datastore.build([[], []], vocab_size=5)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        Datastore.load(tmp_path / "file")


# ----- corpus formats ------------------------------------------------------------------------------
def test_cli_reads_jsonl_and_directories(corpus, tmp_path, capsys):
    _, model_dir, _ = corpus
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text(
        json.dumps({"text": "def alpha(): return 1"}) + "\n\n"
        + json.dumps({"question_id": 1, "turns": ["first turn", "second turn"]}) + "\n"
        + json.dumps({"question": "What is 2+2?", "answer": "4"}) + "\n"
    )
    assert stree_main(["datastore", "build", str(jsonl), "--tokenizer", str(model_dir), "--out",
                       str(tmp_path / "ds1"), "--quiet"]) == 0
    assert Datastore.load(tmp_path / "ds1").num_sequences == 3
    tree_dir = tmp_path / "src"
    (tree_dir / "pkg").mkdir(parents=True)
    (tree_dir / "pkg" / "a.py").write_text("import os\n")
    (tree_dir / "README.md").write_text("# Title\n")
    (tree_dir / "notes.txt").write_text("some notes\n")
    (tree_dir / "image.bin").write_bytes(b"\x00\x01")
    assert stree_main(["datastore", "build", str(tree_dir), "--tokenizer", str(model_dir / "tokenizer.json"),
                       "--out", str(tmp_path / "ds2"), "--quiet"]) == 0
    assert Datastore.load(tmp_path / "ds2").num_sequences == 3
    assert "3 documents" in capsys.readouterr().out


def test_cli_bad_corpus_and_tokenizer(corpus, tmp_path, capsys):
    _, model_dir, _ = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"id": 3}) + "\n")
    args = ["--tokenizer", str(model_dir), "--out", str(tmp_path / "ds"), "--quiet"]
    assert stree_main(["datastore", "build", str(bad)] + args) == 2
    assert "bad.jsonl:2: no 'text'" in capsys.readouterr().err
    assert stree_main(["datastore", "build", str(tmp_path / "missing.txt")] + args) == 2
    assert "missing.txt does not exist" in capsys.readouterr().err
    (tmp_path / "c.txt").write_text("hello")
    assert stree_main(["datastore", "build", str(tmp_path / "c.txt"), "--tokenizer", str(tmp_path),
                       "--out", str(tmp_path / "ds"), "--quiet"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
