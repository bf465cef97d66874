"""TreeFlash's network: one block pass from the target's hidden state to K depth states, plus a
conditional head that re-scores a depth's children per parent token.

The block pass reads the target's final-norm hidden state at the last accepted node and the root
token, and emits one state per depth below the root, all at once (no draft step per level). The
marginal head reads a depth's state alone, so every branch at that depth would share its
distribution; the conditional head adds the parent token through a small MLP, approximating the
autoregressive distribution of a child given its parent. Saved as config.json + model.safetensors.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from stree.verifier.model.weights_home import WeightsHome

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DEFAULT_D_MODEL, DEFAULT_DEPTH, DEFAULT_N_LAYER = 128, 4, 2
"""The drafter's default width, depths and mixer blocks, shared with its training config and CLI flags."""


@dataclass(frozen=True)
class TreeFlashConfig:
    """Sizes: the target's hidden width and vocabulary, the drafter's width, depths, mixer blocks."""

    d_target: int
    vocab_size: int
    d_model: int = DEFAULT_D_MODEL
    depth: int = DEFAULT_DEPTH
    n_layer: int = DEFAULT_N_LAYER
    mlp_mult: int = 2

    def __post_init__(self):
        for f in fields(self):
            if int(getattr(self, f.name)) < 1:
                raise ValueError(f"TreeFlashConfig.{f.name} must be >= 1, got {getattr(self, f.name)}")


class _MLP(nn.Module):
    """``down(silu(up(norm(x))))``: the residual branch of every block."""

    def __init__(self, d_in: int, d_out: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(d_in, eps=1e-5)
        self.up = nn.Linear(d_in, hidden)
        self.down = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.down(F.silu(self.up(self.norm(x))))


class _MixerBlock(nn.Module):
    """Depths exchange information (a linear map over the depth axis), then a per-depth MLP."""

    def __init__(self, cfg: TreeFlashConfig):
        super().__init__()
        self.mix_norm = nn.RMSNorm(cfg.d_model, eps=1e-5)
        self.mix = nn.Linear(cfg.depth, cfg.depth)
        self.mlp = _MLP(cfg.d_model, cfg.d_model, cfg.mlp_mult * cfg.d_model)

    def forward(self, x):  # [B, K, d]
        x = x + self.mix(self.mix_norm(x).transpose(1, 2)).transpose(1, 2)
        return x + self.mlp(x)


class TreeFlashNet(WeightsHome, nn.Module):
    """Block pass (``depth_states``), marginal head and conditional head over a tied embedding."""

    def __init__(self, cfg: TreeFlashConfig):
        super().__init__()
        self.config = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.in_proj = nn.Linear(cfg.d_target, cfg.d_model)
        self.depth_emb = nn.Parameter(torch.randn(cfg.depth, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList([_MixerBlock(cfg) for _ in range(cfg.n_layer)])
        self.cond = _MLP(2 * cfg.d_model, cfg.d_model, cfg.mlp_mult * cfg.d_model)
        self.norm_f = nn.RMSNorm(cfg.d_model, eps=1e-5)
        nn.init.normal_(self.embedding.weight, std=0.02)  # the tied head starts near uniform (small KL)

    def _home_weight(self) -> torch.Tensor:
        return self.embedding.weight

    def depth_states(self, hidden: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        """``[B, d_target]`` target hidden states and ``[B]`` roots -> ``[B, K, d]``; state k drafts depth k+1."""
        x = (self.in_proj(hidden.to(self.dtype)) + self.embedding(roots))[:, None] + self.depth_emb
        for block in self.blocks:
            x = block(x)
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return (self.norm_f(x) @ self.embedding.weight.t()).float()

    def marginal_logits(self, states: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` depth states -> ``[..., V]`` logits shared by every branch at that depth."""
        return self._head(states)

    def conditional_logits(self, states: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` depth states and ``[...]`` parent tokens -> ``[..., V]`` child logits given the parent."""
        x = torch.cat([states, self.embedding(parents)], dim=-1)
        return self._head(states + self.cond(x))


def save_treeflash(net: TreeFlashNet, path) -> Path:
    """Write ``path/config.json`` and ``path/model.safetensors``; returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps({"kind": "treeflash", **asdict(net.config)}, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE))
    return path


def is_treeflash_checkpoint(path) -> bool:
    """Whether ``path`` holds a TreeFlash checkpoint (its config.json says ``"kind": "treeflash"``)."""
    config = Path(path) / CONFIG_FILE
    try:
        return config.is_file() and json.loads(config.read_text()).get("kind") == "treeflash"
    except (OSError, ValueError, AttributeError):
        return False


def load_treeflash(path, device="cpu", dtype=torch.float32) -> TreeFlashNet:
    """A ``TreeFlashNet`` from a directory written by ``save_treeflash``."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not a TreeFlash checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    raw = json.loads((path / CONFIG_FILE).read_text())
    if raw.pop("kind", None) != "treeflash":
        raise ValueError(f"{path / CONFIG_FILE} is not a TreeFlash config (kind must be 'treeflash')")
    net = TreeFlashNet(TreeFlashConfig(**raw))
    net.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
    return net.to(device=device, dtype=dtype).eval()
