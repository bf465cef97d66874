"""Tiny random transformers models saved to disk, and checks of a loaded StreeLM against transformers' own forward."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from stree.protocols.token_tree import TokenTree



def perturb_(hf_model, seed: int = 0) -> None:
    """Non-trivial D, dt bias and norm weights (transformers initialises them to constants)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith(".D") or "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-3.0, 0.0, generator=g))


def save_tiny(hf_model, out_dir, shard: str | None = None):
    hf_model.save_pretrained(str(out_dir), max_shard_size=shard) if shard else hf_model.save_pretrained(str(out_dir))
    return out_dir


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids]), use_cache=False).logits[0].float()


def check_scores(model, hf_model, vocab: int, prefix_len: int = 7, atol: float = 1e-4) -> None:
    """score_sequence equals HF logits; score_tree at every node equals HF's forward of the root-to-node path."""
    ids = torch.randint(0, vocab, (prefix_len + 5,)).tolist()
    torch.testing.assert_close(model.score_sequence(ids), hf_logits(hf_model, ids), atol=atol, rtol=1e-4)
    toks = torch.randint(0, vocab, (7,)).tolist()
    tree = TokenTree.from_parents(toks, [-1, 0, 0, 1, 1, 2, 4])
    prefix = ids[:prefix_len]
    got = model.score_tree(prefix, tree)
    for node in range(tree.num_nodes):
        want = hf_logits(hf_model, prefix + tree.path_tokens(node))[-1]
        torch.testing.assert_close(got[node], want, atol=atol, rtol=1e-4)


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt], device=hf_model.device), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ----- tiny random models of each supported family (transformers' own classes) -----------------------
V = 64

# family -> (transformers class prefix, config kwargs of its tiny model, parameter-name words drawn at random)
TINY = {
    "mamba2": ("Mamba2", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, head_dim=8,
                              num_heads=8, n_groups=2, chunk_size=16, tie_word_embeddings=False,
                              layer_norm_epsilon=1e-2), ()),
    "bamba": ("Bamba", dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
                            mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=16, rms_norm_eps=1e-2), ()),
    "nemotron_h": ("NemotronH", dict(
        vocab_size=V, hidden_size=32, layers_block_type=["mamba", "moe", "attention", "mlp"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8,
        ssm_state_size=8, n_groups=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=20, chunk_size=16, layer_norm_epsilon=1e-2, time_step_min=0.05,
        routed_scaling_factor=1.5), ("experts", "gate")),
    "granitemoehybrid": ("GraniteMoeHybrid", dict(
        vocab_size=V, hidden_size=32, intermediate_size=24, shared_intermediate_size=20, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4,
        mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2,
        position_embedding_type="rope", embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=2.5, rms_norm_eps=1e-2), ("experts", "router")),
    # Mamba SSM width 1.5x hidden, grouped gated norm and every muP multiplier away from 1
    "falcon_h1": ("FalconH1", dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_state=8, mamba_n_groups=2,
        mamba_chunk_size=16, mamba_rms_norm=True, rms_norm_eps=1e-2, embedding_multiplier=2.0, lm_head_multiplier=0.5,
        mlp_multipliers=[0.7, 1.3], key_multiplier=1.5, attention_in_multiplier=0.8, attention_out_multiplier=1.2,
        ssm_multipliers=[0.9, 1.1, 0.6, 1.4, 0.5], ssm_in_multiplier=1.3, ssm_out_multiplier=0.7), ()),
    # two shared blocks used in turn by three hybrid layers (the third reuses the first block's weights), q/k/v
    # and MLP LoRA adapters, RoPE, and random (non-zero) adapter weights
    "zamba2": ("Zamba2", dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, layers_block_type=["mamba", "hybrid", "mamba", "hybrid",
                                                                               "hybrid"],
        num_attention_heads=4, n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=2, chunk_size=16, num_mem_blocks=2,
        use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True, rms_norm_eps=1e-2,
        time_step_min=0.01), ("adapter_list",)),
    # the Llama half of a MambaInLlama checkpoint (with every layer attention: a plain LlamaForCausalLM)
    "llama": ("Llama", dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-2, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), ()),
}


def tiny_kwargs(family: str, **over) -> dict:
    """The config kwargs of ``family``'s tiny model with ``over`` applied (Zamba2's layer count follows its layer
    list unless given)."""
    kw = {**TINY[family][1], **over}
    if family == "zamba2" and "num_hidden_layers" not in over:
        kw["num_hidden_layers"] = len(kw["layers_block_type"])
    return kw


def build_tiny(family: str, random_biases: bool = False, **over):
    """``family``'s tiny ``{prefix}ForCausalLM``: seeded, norms / D / dt perturbed, routing (and with
    ``random_biases`` every bias) drawn at random."""
    prefix, _, routing = TINY[family]
    torch.manual_seed(0)
    hf = getattr(_tf(), f"{prefix}ForCausalLM")(getattr(_tf(), f"{prefix}Config")(**tiny_kwargs(family, **over))).eval()
    perturb_(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(word in name for word in routing) or (random_biases and name.endswith(".bias")):
                p.normal_(0, 0.2)
        if family == "nemotron_h":
            for layer in hf.model.layers:
                if layer.block_type == "moe":
                    layer.mixer.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return hf


def mamba2_tiny(**over):
    """transformers' plain Mamba2ForCausalLM (two layers, grouped B/C)."""
    return build_tiny("mamba2", **over)


BUILDERS = {name: (lambda name: lambda **over: build_tiny(name, **over))(name)
            for name in ("bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2")}
DRAFTS = {"bamba": dict(num_hidden_layers=1, attn_layer_indices=[]), "nemotron_h": dict(layers_block_type=["mamba"]),
          "granitemoehybrid": dict(num_hidden_layers=1, layer_types=["mamba"]), "falcon_h1": dict(num_hidden_layers=1),
          "zamba2": dict(layers_block_type=["mamba", "hybrid"], num_mem_blocks=1)}


def write_llama_as_mambainllama(hf, out):
    """A LlamaForCausalLM saved as a MambaInLlama checkpoint whose every layer is attention (``mamba_config.json``
    lists them all), so transformers' own Llama forward is its reference."""
    save_tiny(hf, out)
    c = hf.config
    mcfg = {"d_model": c.hidden_size, "ssm_cfg": {"d_state": 8, "ngroups": 4}, "d_inner": 32, "d_xb": 16,
            "intermediate_size": c.intermediate_size, "n_layer": c.num_hidden_layers, "rms_norm_eps": c.rms_norm_eps,
            "vocab_size": c.vocab_size, "attn_layers": list(range(c.num_hidden_layers))}
    (out / "mamba_config.json").write_text(json.dumps(mcfg))
    return out


def tiny_pair(name: str, root) -> dict:
    """Target and draft checkpoint folders for family ``name`` (a ``BUILDERS`` key, ``mamba2`` or ``mambainllama``),
    written in that family's own format."""
    if name == "mamba2":
        return {"target": save_tiny(mamba2_tiny(), root / "t"), "draft": save_tiny(mamba2_tiny(num_hidden_layers=1),
                                                                                   root / "d")}
    if name == "mambainllama":
        return {"target": write_mambainllama(root / "t", *mambainllama_tiny(3, [1])),
                "draft": write_mambainllama(root / "d", *mambainllama_tiny(1, [], seed=1))}
    return {"target": save_tiny(BUILDERS[name](), root / "t"), "draft": save_tiny(BUILDERS[name](**DRAFTS[name]), root / "d")}


FAMILIES = sorted(BUILDERS) + ["mamba2", "mambainllama"]


def _tf():
    import transformers

    return transformers


# MambaInLlama (jxiw/MambaInLlama mamba2/): Llama config.json + mamba_config.json, written in their key names
D, HEADS, KV, HD, FF, EPS = 32, 4, 2, 8, 48, 1e-2
D_STATE, NGROUPS, D_INNER, D_XB, K = 8, 4, 32, 16, 4  # d_xb = KV*HD: each x/B group serves 2 heads


def mambainllama_tiny(n_layer: int, attn_layers: list[int], before_conv: bool = False, seed: int = 0) -> tuple[dict, dict, dict]:
    """(config.json, mamba_config.json, state dict) with their key names and random weights."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2, lo=None, hi=None):
        if lo is not None:
            return torch.empty(shape).uniform_(lo, hi, generator=g)
        return torch.randn(shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": rnd(V, D, scale=1.0), "model.norm.weight": rnd(D, lo=0.5, hi=1.5),
          "lm_head.weight": rnd(V, D)}
    conv_dim = 3 * D_INNER if before_conv else D_INNER + 2 * D_XB
    for i in range(n_layer):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = rnd(D, lo=0.5, hi=1.5)
        sd[p + "post_attention_layernorm.weight"] = rnd(D, lo=0.5, hi=1.5)
        for name, shape in (("gate_proj", (FF, D)), ("up_proj", (FF, D)), ("down_proj", (D, FF))):
            sd[p + f"mlp.{name}.weight"] = rnd(*shape)
        if i in attn_layers:
            for name, rows in (("q_proj", HEADS * HD), ("k_proj", KV * HD), ("v_proj", KV * HD)):
                sd[p + f"self_attn.{name}.weight"] = rnd(rows, D)
            sd[p + "self_attn.o_proj.weight"] = rnd(D, HEADS * HD)
        else:
            m = p + "mamba."
            sd[m + "in_proj.weight"] = rnd(2 * D_INNER + 2 * D_XB + NGROUPS, D)
            sd[m + "conv1d.weight"] = rnd(conv_dim, 1, K, scale=0.4)
            sd[m + "conv1d.bias"] = rnd(conv_dim, scale=0.1)
            sd[m + "dt_bias"] = rnd(NGROUPS, lo=-3.0, hi=0.0)
            sd[m + "A_log"] = rnd(NGROUPS, lo=-1.0, hi=1.0)
            sd[m + "D"] = rnd(NGROUPS, lo=0.5, hi=1.5)
            sd[m + "norm.weight"] = rnd(D_INNER, lo=0.5, hi=1.5)
            sd[m + "out_proj.weight"] = rnd(D, D_INNER)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D, "intermediate_size": FF,
           "num_hidden_layers": n_layer, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
           "vocab_size": V, "rms_norm_eps": EPS, "rope_theta": 500000.0, "rope_scaling": None, "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32"}
    ssm_cfg = {"expand": 1, "ngroups": NGROUPS, "d_state": D_STATE}
    if before_conv:
        ssm_cfg["repeat_kv_before_conv"] = True
    mcfg = {"d_model": D, "ssm_cfg": ssm_cfg, "rms_norm_eps": EPS, "vocab_size": V, "d_inner": D_INNER,
            "d_xb": D_XB, "intermediate_size": FF, "hidden_act": "silu", "n_layer": n_layer,
            "attn_layers": attn_layers}
    return cfg, mcfg, sd


def write_mambainllama(out, cfg, mcfg, sd):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    if mcfg is not None:
        (out / "mamba_config.json").write_text(json.dumps(mcfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return out

