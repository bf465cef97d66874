"""``stree bench serve`` against a tiny live server, over HTTP and gRPC, with a tiny load."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx")

from stree.cli import main as stree_main  # noqa: E402
from stree.proto.rpc import shared_loop  # noqa: E402
from stree.verifier.model.checkpoint import init_model, load_model  # noqa: E402
from stree.verifier.model.tokenizer import load_tokenizer  # noqa: E402
from stree.verifier.service.server import EmbeddedDrafters, GenerationServer, ServerLimits  # noqa: E402


def test_bench_serve_http_and_grpc(tmp_path):
    model_dir = init_model(tmp_path / "tiny", d_model=32, n_layer=1, vocab_size=64, seed=8)
    server = GenerationServer(load_model(model_dir), load_tokenizer(model_dir), EmbeddedDrafters("ngram"),
                              http_port=0, model_name="tiny", limits=ServerLimits(max_sessions=2, max_seq_len=256))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"Q{i} A B A B"}) + "\n" for i in range(4)))
    loop = shared_loop()
    loop.run(server.start())
    try:
        for url in (f"http://{server.http.address}", f"grpc://{server.address}"):
            out = tmp_path / url.split(":")[0]
            assert stree_main(["bench", "serve", "--url", url, "--prompt-set", "gsm8k", "--prompt-file",
                               str(prompts), "--num-prompts", "4", "--max-tokens", "5", "--request-rate", "inf,40",
                               "--max-concurrency", "2", "--out", str(out)]) == 0
            rows = json.loads((out / "serve_bench.json").read_text())["results"]
            assert [(r["request_rate"], r["completed"], r["failed"]) for r in rows] == [("inf", 4, 0), (40.0, 4, 0)]
            assert all(r["output_tokens"] == 20 and r["ttft"]["p50_ms"] > 0 for r in rows)
            assert (out / "serve_bench.png").stat().st_size > 0
    finally:
        loop.run(server.stop(0), 30)
