"""Drafting ahead is turned on per remote drafter (``stree serve --draft-ahead N``, Ray Serve's ``draft_ahead``,
``RemoteDrafter(overlap=N)``); a bad value or one for an in-process drafter is a clear error before anything
loads."""

from __future__ import annotations

import pytest

from stree.cli import main

URL = "grpc://127.0.0.1:1/chain"


@pytest.mark.parametrize("argv, needle", [
    (["--drafter", URL, "--draft-ahead", "-1"], "--draft-ahead must be from 0 to 64 trees, got -1"),
    (["--drafter", URL, "--draft-ahead", "65"], "--draft-ahead must be from 0 to 64 trees, got 65"),
    (["--drafter", "ngram", "--draft-ahead", "2"], "--draft-ahead is for a remote drafter"),
    (["--draft-ahead", "2"], "--draft-ahead is for a remote drafter"),
])
def test_serve_refuses_bad_draft_ahead(model_dirs, capsys, argv, needle):
    assert main(["serve", str(model_dirs["mamba2"]), "--port", "0", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_serve_draft_ahead_must_be_a_number(model_dirs, capsys):
    with pytest.raises(SystemExit):
        main(["serve", str(model_dirs["mamba2"]), "--drafter", URL, "--draft-ahead", "many"])
    assert "--draft-ahead: invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize("value", [-1, 65, 2.5, True, "4"])
def test_remote_drafter_refuses_bad_overlap(value):
    from stree.verifier.service.remote_drafter import RemoteDrafter

    with pytest.raises(ValueError, match="overlap must be a whole number of hypotheses from 0 to 64"):
        RemoteDrafter(URL, overlap=value)


def test_ray_serve_app_checks_draft_ahead(model_dirs):
    pytest.importorskip("ray.serve")
    from stree.verifier.service.ray_serve import app_builder, check_draft_ahead

    assert check_draft_ahead(URL, 4) == 4 and check_draft_ahead("none", 0) == 0
    with pytest.raises(ValueError, match="draft_ahead is for a remote drafter"):
        app_builder({"model_dir": str(model_dirs["mamba2"]), "drafter": "ngram", "draft_ahead": "2"})
    with pytest.raises(ValueError, match="draft_ahead must be a whole number, got 'x'"):
        app_builder({"model_dir": str(model_dirs["mamba2"]), "drafter": URL, "draft_ahead": "x"})
    with pytest.raises(ValueError, match="draft_ahead must be a whole number from 0 to 64, got 70"):
        app_builder({"model_dir": str(model_dirs["mamba2"]), "drafter": URL, "draft_ahead": 70})
    app = app_builder({"model_dir": str(model_dirs["mamba2"]), "drafter": URL, "draft_ahead": "3"})
    assert type(app).__name__ == "Application"


def test_drafter_service_device_choice(capsys):
    from stree.drafter_service.actors import PoolConfig, device_for_this_process

    with pytest.raises(SystemExit):
        main(["drafter-service", "--no-supervise", "--drafters", "ngram", "--device", "tpu"])
    assert "--device: invalid choice: 'tpu'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        PoolConfig(device="tpu")
    with pytest.raises(ValueError, match="device cuda needs num_gpus > 0"):
        PoolConfig(device="cuda", num_gpus=0)
    assert device_for_this_process("cpu") == "cpu"
    import torch

    if not torch.cuda.is_available():  # no Ray GPU assignment here: auto is the CPU, cuda refuses
        assert device_for_this_process("auto") == "cpu"
        with pytest.raises(ValueError, match="device cuda: this replica has no usable GPU"):
            device_for_this_process("cuda")


def test_drafter_service_dtype_choice(capsys, model_dirs):
    """``stree drafter-service --dtype`` and Ray Serve's ``dtype`` set the weights of model drafters and
    replicas; a dtype they do not know is refused by name before anything loads."""
    import torch

    from stree.drafter_service.actors import DrafterReplica, PoolConfig
    from stree.protocols.registry import get_drafter_factory

    with pytest.raises(SystemExit):
        main(["drafter-service", "--no-supervise", "--drafters", "mamba", "--dtype", "int8"])
    assert "--dtype: invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'int8'"):
        PoolConfig(dtype="int8")
    options = {"draft_model": str(model_dirs["mamba2"])}
    half = DrafterReplica("mamba", get_drafter_factory("mamba"), options, device="cpu", dtype="bfloat16")
    own = DrafterReplica("mamba", get_drafter_factory("mamba"), options, device="cpu")
    assert next(half.drafter.model.parameters()).dtype == torch.bfloat16
    assert next(own.drafter.model.parameters()).dtype == torch.float32
    pytest.importorskip("ray.serve")
    from stree.verifier.service.ray_serve import app_builder

    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'fp8'"):
        app_builder({"model_dir": str(model_dirs["mamba2"]), "dtype": "fp8"})
    assert type(app_builder({"model_dir": str(model_dirs["mamba2"]), "dtype": "bfloat16"})).__name__ == "Application"
