"""Model configuration in mamba_ssm's own ``config.json`` format (the Hugging Face classes map onto it in ``hf/``).

mamba_ssm's ``MambaConfig`` fields are kept by name (``d_model``, ``n_layer``, ``ssm_cfg``,
``attn_layer_idx``, ``attn_cfg``, ...), so a checkpoint written here loads in mamba_ssm and back.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SSM_DEFAULTS: dict[str, Any] = {
    "layer": "Mamba2",
    "d_state": 128,
    "d_conv": 4,
    "expand": 2,
    "headdim": 64,
    "d_ssm": None,
    "ngroups": 1,
    "D_has_hdim": False,
    "rmsnorm": True,
    "norm_before_gate": False,
    "dt_limit": [0.0, math.inf],
    "bias": False,
    "conv_bias": True,
    "chunk_size": 256,
    "norm_eps": 1e-5,
}

ATTN_DEFAULTS: dict[str, Any] = {
    "num_heads": 8,
    "num_heads_kv": None,
    "head_dim": None,
    "mlp_dim": 0,
    "qkv_proj_bias": True,
    "out_proj_bias": True,
    "softmax_scale": None,
    "causal": True,
    "d_conv": 0,
    "rotary_emb_dim": 0,
    "rotary_emb_base": 10000.0,
    "rotary_emb_interleaved": False,
}

# ssm_cfg keys mamba_ssm accepts that only affect initialisation or training kernels.
_SSM_INIT_ONLY = {
    "conv_init", "A_init_range", "dt_min", "dt_max", "dt_init_floor", "use_mem_eff_path",
    "sequence_parallel", "process_group", "activation",
}


def _json_float(value) -> float:
    """A float from JSON, including transformers' ``{"__float__": "Infinity"}`` encoding."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


@dataclass
class ModelConfig:
    """mamba_ssm ``MambaConfig`` (Mamba2 mixers, optional attention layers and gated MLPs)."""

    d_model: int = 768
    d_intermediate: int = 0
    n_layer: int = 24
    vocab_size: int = 50277
    ssm_cfg: dict = field(default_factory=dict)
    attn_layer_idx: list = field(default_factory=list)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    norm_epsilon: float = 1e-5
    mlp_multiple: int = 128
    mlp_bias: bool = False  # biases on the gated MLP's projections (transformers' ``mlp_bias``)
    layer_mixers: dict = field(default_factory=dict)  # layer index -> per-token mixer spec (token_mixers.py)
    moe_mlp: dict = field(default_factory=dict)  # non-empty: every block's MLP is a SoftmaxMoEMLP of this spec
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # scales each mixer / MLP output before the residual add
    logits_scaling: float = 1.0  # logits are divided by this
    parallel_mamba: bool = False  # every attention layer also runs a Mamba2 mixer on its input; outputs summed
    # Zamba2 hybrid layers: attention over [hidden; embeddings] + an MLP (hybrid_mlp: {"hidden", "act", "bias"}),
    # projected and added to the input of the layer's Mamba2 mixer (shared_block_mixer.py)
    hybrid_layer_idx: list = field(default_factory=list)
    hybrid_mlp: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple", "mlp_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.d_intermediate, int) or self.d_intermediate < 0:
            raise ValueError(f"config: d_intermediate must be an integer >= 0, got {self.d_intermediate!r}")
        layer = (self.ssm_cfg or {}).get("layer", "Mamba2")
        if layer != "Mamba2":
            raise ValueError(f"config: ssm_cfg.layer {layer!r} is not supported (only 'Mamba2')")
        self.attn_layer_idx = [int(i) for i in (self.attn_layer_idx or [])]
        self.layer_mixers = {int(k): dict(v) for k, v in (self.layer_mixers or {}).items()}
        self.hybrid_layer_idx = [int(i) for i in (self.hybrid_layer_idx or [])]
        for i in self.hybrid_layer_idx:
            if not 0 <= i < self.n_layer or i in self.attn_layer_idx or i in self.layer_mixers:
                raise ValueError(f"config: hybrid_layer_idx {i} is outside 0..{self.n_layer - 1} or another layer kind")
        if self.hybrid_layer_idx:
            mlp = self.hybrid_mlp or {}
            if mlp.get("act") not in ("gelu", "silu") or not isinstance(mlp.get("hidden"), int) or mlp["hidden"] <= 0:
                raise ValueError(f"config: hybrid_mlp {mlp!r} needs a positive integer 'hidden' and act 'gelu' or 'silu'")
        for i in self.layer_mixers:
            if not 0 <= i < self.n_layer or i in self.attn_layer_idx:
                raise ValueError(f"config: layer_mixers index {i} is outside 0..{self.n_layer - 1} or an attention layer")
        for i in self.attn_layer_idx:
            if not 0 <= i < self.n_layer:
                raise ValueError(f"config: attn_layer_idx {i} is outside 0..{self.n_layer - 1}")
        ssm = self.ssm
        if ssm["d_ssm"] % ssm["headdim"]:
            raise ValueError(
                f"config: d_ssm {ssm['d_ssm']} (expand*d_model) is not a multiple of headdim {ssm['headdim']}"
            )
        if self.nheads % ssm["ngroups"]:
            raise ValueError(f"config: {self.nheads} heads do not split into {ssm['ngroups']} groups")
        if ssm["d_conv"] < 1:
            raise ValueError("config: ssm_cfg.d_conv must be >= 1")
        if self.parallel_mamba and not self.attn_layer_idx:
            raise ValueError("config: parallel_mamba needs attention layers (attn_layer_idx) to run beside")
        if self.attn_layer_idx or self.hybrid_layer_idx:
            attn = self.attn
            if attn["d_conv"]:
                raise ValueError("config: attn_cfg.d_conv > 0 (conv in attention layers) is not supported")
            if not attn["causal"]:
                raise ValueError("config: attn_cfg.causal must be true for a language model")
            if attn["num_heads"] % attn["num_heads_kv"]:
                raise ValueError("config: attn_cfg.num_heads must be a multiple of num_heads_kv")

    # ----- resolved views -----------------------------------------------------------------
    @property
    def ssm(self) -> dict:
        """ssm_cfg with mamba_ssm's defaults filled in and d_ssm resolved."""
        cfg = {**SSM_DEFAULTS, **{k: v for k, v in (self.ssm_cfg or {}).items() if k not in _SSM_INIT_ONLY}}
        unknown = set(cfg) - set(SSM_DEFAULTS)
        if unknown:
            raise ValueError(f"config: unknown ssm_cfg keys {sorted(unknown)}")
        d_inner = round(cfg["expand"] * self.d_model)  # expand may be fractional (Falcon-H1's mamba_d_ssm)
        if abs(d_inner - cfg["expand"] * self.d_model) > 1e-6:
            raise ValueError(f"config: ssm_cfg.expand {cfg['expand']} times d_model {self.d_model} is not an integer")
        cfg["d_inner"] = d_inner
        cfg["d_ssm"] = d_inner if cfg["d_ssm"] is None else cfg["d_ssm"]
        cfg["dt_limit"] = [_json_float(x) for x in cfg["dt_limit"]]
        return cfg

    @property
    def attn(self) -> dict:
        cfg = {**ATTN_DEFAULTS, **(self.attn_cfg or {})}
        unknown = set(cfg) - set(ATTN_DEFAULTS)
        if unknown:
            raise ValueError(f"config: unknown attn_cfg keys {sorted(unknown)}")
        if cfg["num_heads_kv"] is None:
            cfg["num_heads_kv"] = cfg["num_heads"]
        if cfg["head_dim"] is None:
            cfg["head_dim"] = self.d_model // cfg["num_heads"]
        return cfg

    @property
    def nheads(self) -> int:
        ssm = self.ssm
        return ssm["d_ssm"] // ssm["headdim"]

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def mlp_hidden(self) -> int:
        """GatedMLP width as mamba_ssm rounds it (multiple of 128)."""
        m = self.mlp_multiple
        return (self.d_intermediate + m - 1) // m * m

    def is_attention(self, layer: int) -> bool:
        return layer in self.attn_layer_idx

    def layer_kind(self, layer: int) -> str:
        """'attn', 'parallel' (attention and Mamba2 side by side), 'hybrid' (Zamba2: attention + MLP feeding the
        Mamba2 mixer's input), 'token' (a per-token MLP/MoE in the mixer slot) or 'mamba'."""
        if layer in self.hybrid_layer_idx:
            return "hybrid"
        if layer in self.attn_layer_idx:
            return "parallel" if self.parallel_mamba else "attn"
        return "token" if layer in self.layer_mixers else "mamba"

    # ----- (de)serialisation ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ValueError("config: expected a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        missing = [k for k in ("d_model", "n_layer", "vocab_size") if k not in data]
        if missing:
            raise ValueError(f"config: missing required keys {missing}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["mlp_multiple"] == 128:  # mamba_ssm's own rounding: keep its config format unchanged
            out.pop("mlp_multiple")
        for key, default in (("layer_mixers", {}), ("moe_mlp", {}), ("embedding_multiplier", 1.0),
                             ("residual_multiplier", 1.0), ("logits_scaling", 1.0), ("parallel_mamba", False),
                             ("mlp_bias", False), ("hybrid_layer_idx", []), ("hybrid_mlp", {})):
            if out[key] == default:  # HF-family options stay out of mamba_ssm-format configs
                out.pop(key)
        ssm = dict(out["ssm_cfg"])
        if "dt_limit" in ssm:
            ssm["dt_limit"] = [x if math.isfinite(x) else 1e30 for x in map(float, ssm["dt_limit"])]
        out["ssm_cfg"] = ssm
        return out
