"""Ray Serve scale-out on a local Ray cluster: 2 verifier replicas, requests spread over both, outputs exact."""

from __future__ import annotations

import socket
import threading

import pytest

serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

import ray  # noqa: E402

from stree.drafter_service.actors import init_ray  # noqa: E402
from stree.verifier.decode.loop import generate  # noqa: E402
from stree.verifier.model.checkpoint import init_model, load_model  # noqa: E402
from stree.verifier.model.tokenizer import load_tokenizer  # noqa: E402
from stree.verifier.service.ray_serve import app_builder  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_replicas_share_the_load_with_exact_output(tmp_path):
    model_dir = init_model(tmp_path / "tiny", d_model=32, n_layer=1, vocab_size=64, seed=9)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    prompts = [f"P{i} {chr(65 + i)}" for i in range(12)]
    want = {p: generate(model, tok.encode(p).ids, max_new_tokens=4).token_ids for p in prompts}
    init_ray("local")
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder({"model_dir": str(model_dir), "num_replicas": 2, "gpus_per_replica": 0,
                               "served_model_name": "tiny", "device": "cpu",
                               "limits": {"max_sessions": 4, "max_seq_len": 256}}),
                  name="stree", route_prefix="/")
        got, replicas, errors = {}, set(), []

        def one(p):
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                               json={"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0})
                got[p] = r.json()["choices"][0]["token_ids"]
                replicas.add(r.headers["x-stree-replica"])
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

        for _ in range(3):  # rounds of concurrent requests until both replicas have answered
            threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            if len(replicas) == 2:
                break
        assert errors == [] and got == want
        assert len(replicas) == 2
    finally:
        serve.shutdown()
        ray.shutdown()


def test_rayservice_manifest_builds_the_app():
    import pathlib

    import yaml

    manifest = pathlib.Path(__file__).parents[2] / "deploy" / "kuberay" / "rayservice.yaml"
    spec = yaml.safe_load(manifest.read_text())["spec"]
    app = yaml.safe_load(spec["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "stree.verifier.service.ray_serve:app_builder"
    assert type(app_builder(app["args"])).__name__ == "Application"
    with pytest.raises(ValueError, match="model_dir"):
        app_builder({})
