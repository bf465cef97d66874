"""Tiny random transformers models saved to disk, and checks of a loaded StreeLM against transformers' own forward."""

from __future__ import annotations

import torch

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
        return hf_model(torch.tensor([ids])).logits[0].float()


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


def _build(prefix: str, kw: dict, routing: tuple[str, ...] = ()):
    """``{prefix}ForCausalLM`` from ``{prefix}Config(**kw)``, seeded, with perturbed norms and random routing weights."""
    torch.manual_seed(0)
    hf = getattr(_tf(), f"{prefix}ForCausalLM")(getattr(_tf(), f"{prefix}Config")(**kw)).eval()
    perturb_(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(word in name for word in routing):
                p.normal_(0, 0.2)
    return hf


def _bamba(**over):
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=8,
              mamba_n_groups=2, mamba_chunk_size=16, rms_norm_eps=1e-2)
    return _build("Bamba", {**kw, **over})


def _nemotron_h(**over):
    kw = dict(vocab_size=V, hidden_size=32, layers_block_type=["mamba", "moe", "attention", "mlp"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8,
              mamba_head_dim=8, ssm_state_size=8, n_groups=2, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=24, moe_shared_expert_intermediate_size=20, chunk_size=16,
              layer_norm_epsilon=1e-2, time_step_min=0.05, routed_scaling_factor=1.5)
    hf = _build("NemotronH", {**kw, **over}, routing=("experts", "gate"))
    with torch.no_grad():
        for layer in hf.model.layers:
            if layer.block_type == "moe":
                layer.mixer.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return hf


def _granite(**over):
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=24, shared_intermediate_size=20, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
              mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=16, num_local_experts=4,
              num_experts_per_tok=2, position_embedding_type="rope", embedding_multiplier=3.0,
              residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5, rms_norm_eps=1e-2)
    return _build("GraniteMoeHybrid", {**kw, **over}, routing=("experts", "router"))


def _falcon_h1(**over):
    """Mamba SSM width 1.5x hidden, grouped gated norm and every muP multiplier away from 1."""
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_state=8, mamba_n_groups=2,
              mamba_chunk_size=16, mamba_rms_norm=True, rms_norm_eps=1e-2, embedding_multiplier=2.0,
              lm_head_multiplier=0.5, mlp_multipliers=[0.7, 1.3], key_multiplier=1.5, attention_in_multiplier=0.8,
              attention_out_multiplier=1.2, ssm_multipliers=[0.9, 1.1, 0.6, 1.4, 0.5], ssm_in_multiplier=1.3,
              ssm_out_multiplier=0.7)
    return _build("FalconH1", {**kw, **over})


def _zamba2(**over):
    """Two shared blocks used in turn by three hybrid layers (the third reuses the first block's weights),
    q/k/v and MLP LoRA adapters, RoPE, and random (non-zero) adapter weights."""
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
              layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], num_attention_heads=4,
              n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=2, chunk_size=16, num_mem_blocks=2,
              use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True, rms_norm_eps=1e-2,
              time_step_min=0.01)
    kw.update(over)
    kw["num_hidden_layers"] = len(kw["layers_block_type"])
    return _build("Zamba2", kw, routing=("adapter_list",))


BUILDERS = {"bamba": _bamba, "nemotron_h": _nemotron_h, "granitemoehybrid": _granite, "falcon_h1": _falcon_h1,
            "zamba2": _zamba2}
DRAFTS = {"bamba": dict(num_hidden_layers=1, attn_layer_indices=[]), "nemotron_h": dict(layers_block_type=["mamba"]),
          "granitemoehybrid": dict(num_hidden_layers=1, layer_types=["mamba"]), "falcon_h1": dict(num_hidden_layers=1),
          "zamba2": dict(layers_block_type=["mamba", "hybrid"], num_mem_blocks=1)}




def _tf():
    import transformers

    return transformers
