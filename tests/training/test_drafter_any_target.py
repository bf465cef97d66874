"""``stree train drafter`` on a tiny Hugging Face hybrid (Bamba: Mamba2 + attention, an MLP after every mixer)
with a BPE tokenizer in its folder: the distilled Mamba2 drafter gets more tokens accepted than an untrained one,
and it and a distilled TreeFlash head plug into ``stree generate --draft-model`` with output equal to plain greedy,
the Mamba2 drafter into a live server (``stree serve --draft-model``) too.

The random target's greedy text is far from the corpus, so the drafter learns from the target's own samples
(``--data generated``); the lm_head is scaled up so the target's distribution is not near uniform.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from corpus_helpers import toy_site
from hf_helpers import BUILDERS, save_tiny

from stree.cli import main as stree_main
from stree.training.corpus import list_files
from stree.training.token_cache import bpe_for_corpus
from stree.verifier.decode.loop import generate
from stree.verifier.model.checkpoint import init_model, load_model
from stree.verifier.model.tokenizer import load_tokenizer

VOCAB = 300
PROMPTS = ("def function_3(x):\n    return", '"""Module 7."""\n\ndef', "import os\n")


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    site = toy_site(root, files=16)
    hf = BUILDERS["bamba"](vocab_size=VOCAB)
    with torch.no_grad():
        hf.lm_head.weight.mul_(40)  # logits of a few units: a target with preferences to learn
    target = save_tiny(hf, root / "bamba")
    bpe_for_corpus(list_files(["toypkg"], [site]), VOCAB, 10**6, root / "cache").save(str(target / "tokenizer.json"))
    return target, site, root


def _drafter_args(target, site, root, kind: str, out: Path, steps: int, *extra) -> list[str]:
    return ["train", "drafter", "--target", str(target), "--kind", kind, "--out", str(out), "--layers", "1",
            "--d-model", "32", "--steps", str(steps), "--batch-size", "8", "--seq-len", "32", "--warmup", "5",
            "--eval-every", str(steps), "--packages", "toypkg", "--corpus-root", str(site), "--cache-dir",
            str(root / "cache"), "--workers", "1", "--device", "cpu", *extra]


def _accepted(target, draft, tokenizer) -> float:
    taus = []
    for text in PROMPTS:
        ids = tokenizer.encode(text).ids
        with torch.no_grad():
            out = generate(target, ids, drafter="mamba", draft_model=draft, tree="chain:4", max_new_tokens=40)
        assert out.token_ids == generate(target, ids, max_new_tokens=40).token_ids
        taus.append(out.stats["mean_accepted_length"])
    return sum(taus) / len(taus)


def _generate_ids(capsys, args) -> list[int]:
    capsys.readouterr()
    assert stree_main(["generate", *args, "--max-new-tokens", "24", "--device", "cpu", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]


def test_distilled_mamba_drafter_accepts_more_and_plugs_into_generate(hf_target, capsys):
    target_dir, site, root = hf_target
    out = root / "mamba-drafter"
    args = _drafter_args(target_dir, site, root, "mamba", out, 120, "--d-state", "8", "--headdim", "8",
                         "--data", "generated", "--gen-sequences", "128")
    assert stree_main(args) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["data"]["data"] == "generated" and log["steps"] == 120
    assert log["evals"][-1][1]["val_top1_agreement"] > 0.3
    assert (out / "train_loss.png").stat().st_size > 0
    target = load_model(target_dir, dtype=torch.float32)
    draft = load_model(out)
    assert draft.vocab_size == target.vocab_size == VOCAB
    assert load_tokenizer(out).to_str() == load_tokenizer(target_dir).to_str()
    untrained = load_model(init_model(root / "untrained", arch="mamba2", d_model=32, n_layer=1, d_state=8,
                                      headdim=8, vocab_size=VOCAB, seed=5))
    tokenizer = load_tokenizer(target_dir)
    distilled_tau, untrained_tau = _accepted(target, draft, tokenizer), _accepted(target, untrained, tokenizer)
    assert distilled_tau > untrained_tau + 0.05, (distilled_tau, untrained_tau)

    prompt = ["--prompt-ids", ",".join(map(str, tokenizer.encode(PROMPTS[1]).ids))]
    plain = _generate_ids(capsys, [str(target_dir), *prompt, "--drafter", "none"])
    spec = _generate_ids(capsys, [str(target_dir), *prompt, "--draft-model", str(out), "--drafter", "mamba",
                                  "--tree", "beam:3x2"])
    assert spec == plain
    served = _served_text(target_dir, draft, PROMPTS[1])
    assert served and served == _served_text(target_dir, None, PROMPTS[1])


def _served_text(target_dir, draft, prompt: str) -> str:
    """Greedy text of ``prompt`` from a live server (OpenAI HTTP) of the target, speculating with ``draft``
    (``stree serve --draft-model``'s drafter) or, with None, decoding plainly."""
    import httpx

    from stree.proto.rpc import shared_loop
    from stree.verifier.service.server import EmbeddedDrafters, GenerationServer

    drafters = EmbeddedDrafters("mamba", draft_model=draft) if draft is not None else EmbeddedDrafters("none")
    server = GenerationServer(load_model(target_dir, dtype=torch.float32), load_tokenizer(target_dir), drafters,
                              http_port=0, model_name="hf-hybrid")
    loop = shared_loop()
    loop.run(server.start())
    try:
        reply = httpx.post(f"http://{server.http.address}/v1/completions", timeout=120,
                           json={"model": "hf-hybrid", "prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]
    finally:
        loop.run(server.stop(0), 30)


def test_treeflash_head_for_an_hf_target_plugs_into_generate(hf_target, capsys):
    target_dir, site, root = hf_target
    out = root / "treeflash-drafter"
    assert stree_main(_drafter_args(target_dir, site, root, "treeflash", out, 12, "--depth", "3")) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["kind"] == "treeflash" and log["data"]["data"] == "corpus"
    assert {"val_kl", "val_kl_marginal", "val_top1_depth3"} <= set(log["evals"][-1][1])
    prompt = ["--prompt-ids", ",".join(map(str, load_tokenizer(target_dir).encode(PROMPTS[0]).ids))]
    plain = _generate_ids(capsys, [str(target_dir), *prompt, "--drafter", "none"])
    spec = _generate_ids(capsys, [str(target_dir), *prompt, "--draft-model", str(out), "--drafter", "treeflash",
                                  "--tree", "static:2,2,1"])
    assert spec == plain


def test_drafter_refuses_bad_input_by_name(hf_target, tmp_path, capsys):
    target_dir, site, root = hf_target
    no_tok = save_tiny(BUILDERS["bamba"](vocab_size=VOCAB), tmp_path / "no-tokenizer")
    assert stree_main(_drafter_args(no_tok, site, root, "mamba", tmp_path / "d", 2)) == 2
    assert "--data generated" in capsys.readouterr().err
    assert stree_main([*_drafter_args(target_dir, site, root, "mamba", tmp_path / "d", 2), "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err
