"""Checkpoint files: load mamba_ssm-format and Hugging Face checkpoints (a folder or a Hub id), save, and write
random ones.

Loading needs neither mamba_ssm nor a GPU. A corrupt or mismatched checkpoint raises an error that names the file
and the problem; every tensor the checkpoint holds is loaded, proven equal to one that is (a tied output layer),
or named in a warning or an error.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Callable

import torch

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf import mambainllama
from stree.verifier.model.hf.fields import CheckpointWarning
from stree.verifier.model.hf.registry import resolve
from stree.verifier.model.hub import resolve_model_dir
from stree.verifier.model.lm import DTYPES, StreeLM
from stree.verifier.model.tokenizer import TOKENIZER_FILE, load_tokenizer, make_tokenizer
from stree.verifier.model.treeflash import TreeFlashNet, is_treeflash_checkpoint, load_treeflash

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
TORCH_BIN_FILE = "pytorch_model.bin"


def _read_config(model_dir: Path) -> tuple[ModelConfig, Callable[[dict], dict], dict]:
    """``(config, weight renamer, raw config.json)``; errors name the file."""
    path = model_dir / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no config.json in the checkpoint directory")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    mamba_path = model_dir / mambainllama.MAMBA_CONFIG_FILE
    if isinstance(data, dict) and mamba_path.exists():  # MambaInLlama: the Llama config plus this file
        try:
            data = {**data, mambainllama.MAMBA_CONFIG_KEY: json.loads(mamba_path.read_text())}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{mamba_path}: not valid JSON ({exc})") from exc
    try:
        config, renamer = resolve(data)
        return config, renamer, data
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _read_weights(model_dir: Path) -> tuple[dict, Path]:
    st, pt, index = model_dir / SAFETENSORS_FILE, model_dir / TORCH_BIN_FILE, model_dir / SAFETENSORS_INDEX_FILE
    if st.exists():
        return _load_safetensors(st), st
    if index.exists():
        return _read_sharded(index), index
    if pt.exists():
        try:
            sd = torch.load(str(pt), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"{pt}: cannot read PyTorch weights ({exc})") from exc
        if not isinstance(sd, dict):
            raise ValueError(f"{pt}: expected a state dict, got {type(sd).__name__}")
        return sd, pt
    raise FileNotFoundError(f"{model_dir}: no {SAFETENSORS_FILE}, {SAFETENSORS_INDEX_FILE} or {TORCH_BIN_FILE}")


def _load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:
        raise ValueError(f"{path}: cannot read safetensors weights ({exc})") from exc


def _read_sharded(index: Path) -> dict:
    """Every shard named by ``model.safetensors.index.json``; each tensor must sit in the shard it names."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: weight_map must be a non-empty object")
    sd: dict = {}
    for shard in sorted(set(weight_map.values())):
        path = index.parent / shard
        if not path.exists():
            raise FileNotFoundError(f"{index}: shard {shard} is missing")
        part = _load_safetensors(path)
        wrong = [k for k in part if weight_map.get(k) != shard]
        if wrong:
            raise ValueError(f"{path}: tensors not listed for this shard in {index.name} (e.g. {wrong[:3]})")
        sd.update(part)
    absent = sorted(set(weight_map) - set(sd))
    if absent:
        raise ValueError(f"{index}: tensors listed but absent from their shards (e.g. {absent[:3]})")
    return sd


def config_dtype(data: dict) -> torch.dtype:
    """The checkpoint's ``torch_dtype`` (or ``dtype``) as a torch dtype; float32 when absent."""
    name = data.get("torch_dtype", data.get("dtype")) or "float32"
    if name not in DTYPES:
        raise ValueError(f"config: torch_dtype {name!r} is not supported (one of {sorted(DTYPES)})")
    return DTYPES[name]


def load_draft_model(path: str | os.PathLike, device="cpu", dtype: torch.dtype | None = None,
                     revision: str | None = None, local_files_only: bool = False) -> "StreeLM | TreeFlashNet":
    """A draft model: a TreeFlash drafter's checkpoint, or any checkpoint ``load_model`` reads (folder or Hub id)."""
    model_dir = resolve_model_dir(path, revision, local_files_only)
    if is_treeflash_checkpoint(model_dir):
        return load_treeflash(model_dir, device=device, dtype=dtype or torch.float32)
    return load_model(model_dir, device=device, dtype=dtype)


def load_model(path: str | os.PathLike, device="cpu", dtype: torch.dtype | None = None,
               revision: str | None = None, local_files_only: bool = False) -> StreeLM:
    """Load a checkpoint (mamba_ssm format or a supported HF class) as a ``StreeLM``.

    ``path`` is a folder, or a Hugging Face Hub id (``"state-spaces/mamba2-2.7b"``) fetched as transformers
    fetches one: downloaded into the Hugging Face cache (``revision``: a branch, tag or commit), or read from that
    cache offline (``HF_HUB_OFFLINE=1`` or ``local_files_only=True``). ``dtype`` None keeps the checkpoint's
    ``torch_dtype`` (float32 when it names none).
    """
    model_dir = resolve_model_dir(path, revision, local_files_only)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: not a checkpoint directory")
    config, renamer, data = _read_config(model_dir)
    if dtype is None:
        try:
            dtype = config_dtype(data)
        except ValueError as exc:
            raise ValueError(f"{model_dir / CONFIG_FILE}: {exc}") from exc
    sd, wfile = _read_weights(model_dir)
    try:
        sd = renamer(sd)
    except ValueError as exc:
        raise ValueError(f"{wfile}: {exc}") from exc
    if config.tie_embeddings:
        _tie_or_untie(sd, config, wfile)
    with torch.device("meta"):
        model = StreeLM(config)
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensors (e.g. {unexpected[:3]})")
        raise ValueError(f"{wfile}: weights do not match {CONFIG_FILE}: " + "; ".join(parts))
    for name, ref in expected.items():
        if tuple(sd[name].shape) != tuple(ref.shape):
            raise ValueError(
                f"{wfile}: tensor {name} has shape {tuple(sd[name].shape)}, config implies {tuple(ref.shape)}"
            )
        if not torch.is_floating_point(sd[name]):
            raise ValueError(f"{wfile}: tensor {name} has non-float dtype {sd[name].dtype}")
        if not bool(torch.isfinite(sd[name]).all()):
            raise ValueError(f"{wfile}: tensor {name} contains NaN or Inf")
    model = model.to_empty(device=device)
    model.load_state_dict(sd, strict=False, assign=False)
    if config.tie_embeddings:
        model.lm_head.weight = model.backbone.embedding.weight
    model = model.to(dtype=dtype)
    model.eval()
    model.source_dir = str(model_dir)
    model.tokenizer = load_tokenizer(model_dir)
    return model


def _tie_or_untie(sd: dict, config: ModelConfig, wfile: Path) -> None:
    """A tied model whose checkpoint also holds ``lm_head.weight``: equal to the embedding, it is dropped (the
    tie reads the same tensor); different, the head is loaded untied, with a warning, as transformers does."""
    head, emb = sd.get("lm_head.weight"), sd.get("backbone.embedding.weight")
    if head is None:
        return
    if emb is not None and head.shape == emb.shape and torch.equal(head, emb):
        del sd["lm_head.weight"]
        return
    config.tie_embeddings = False
    warnings.warn(f"{wfile}: the config ties the output layer to the embedding, but lm_head.weight differs from "
                  "it; loaded untied, with the saved lm_head.weight, as transformers does", CheckpointWarning,
                  stacklevel=3)


def save_model(model: StreeLM, out_dir: str | os.PathLike, tokenizer=None, fmt: str = "safetensors") -> Path:
    """Write ``config.json`` (mamba_ssm format) and the weights (``safetensors`` or ``bin``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2))
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    elif fmt == "bin":
        torch.save(sd, out / TORCH_BIN_FILE)
    else:
        raise ValueError(f"unknown weight format {fmt!r}; use 'safetensors' or 'bin'")
    if tokenizer is not None:
        tokenizer.save(str(out / TOKENIZER_FILE))
    return out


def random_init_(model: StreeLM, seed: int, rescale_residual: bool = False) -> StreeLM:
    """Initialise like mamba_ssm: A in [1, 16], dt in [1e-3, 1e-1] log-uniform, D = 1, small normal embeddings.

    Runs on the model's device. ``rescale_residual`` divides each block's output projection by
    sqrt(n_layer), as mamba_ssm's ``rescale_prenorm_residual`` does.
    """
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape, device=dev).uniform_(1.0, 16.0, generator=g)))
            elif name.endswith("dt_bias"):
                u = torch.rand(p.shape, generator=g, device=dev)
                dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith(".D") or "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif "embedding" in name:
                p.normal_(0.0, 0.02, generator=g)
            elif p.dim() >= 2:
                fan_in = p.shape[1] * (p.shape[2] if p.dim() > 2 else 1)
                p.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in), generator=g)
                if rescale_residual and name.endswith("out_proj.weight"):
                    p.div_(math.sqrt(model.config.n_layer))
    return model


def init_model(
    out_dir: str | os.PathLike,
    arch: str = "mamba2",
    d_model: int = 64,
    n_layer: int = 2,
    attn_layers: list[int] | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    d_state: int = 16,
    headdim: int = 16,
    expand: int = 2,
    ngroups: int = 1,
    d_conv: int = 4,
    d_intermediate: int = 0,
    num_heads: int | None = None,
    num_heads_kv: int | None = None,
    rotary_emb_dim: int | None = None,
    fmt: str = "safetensors",
    tokenizer_texts: list[str] | None = None,
) -> Path:
    """Write a random checkpoint (config, weights, tokenizer) that ``load_model`` reads back."""
    if arch not in ("mamba2", "hybrid"):
        raise ValueError(f"arch must be 'mamba2' or 'hybrid', got {arch!r}")
    if arch == "mamba2" and attn_layers:
        raise ValueError("arch='mamba2' has no attention layers; pass arch='hybrid' with attn_layers")
    if arch == "hybrid":
        attn_layers = list(attn_layers) if attn_layers else [n_layer // 2]
    heads = num_heads or max(1, d_model // 16)
    head_dim = d_model // heads
    config = ModelConfig(
        d_model=d_model,
        d_intermediate=d_intermediate,
        n_layer=n_layer,
        vocab_size=vocab_size,
        ssm_cfg={"layer": "Mamba2", "d_state": d_state, "headdim": headdim, "expand": expand,
                 "ngroups": ngroups, "d_conv": d_conv},
        attn_layer_idx=attn_layers or [],
        attn_cfg={"num_heads": heads, "num_heads_kv": num_heads_kv or heads, "head_dim": head_dim,
                  "rotary_emb_dim": head_dim if rotary_emb_dim is None else rotary_emb_dim}
        if attn_layers else {},
    )
    model = random_init_(StreeLM(config), seed)
    return save_model(model, out_dir, tokenizer=make_tokenizer(vocab_size, tokenizer_texts), fmt=fmt)
