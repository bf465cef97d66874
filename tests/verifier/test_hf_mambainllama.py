"""MambaInLlama checkpoints (Llama config.json + mamba_config.json, Mamba2 layers with d_xb shared x/B groups).

Tiny random checkpoints are written in that repository's on-disk layout and the loaded StreeLM is compared with a
plain-PyTorch float64 forward of their layer math written here: GQA-style x/B groups repeated over the heads
after a depthwise conv over [x (d_xb) | B (d_xb) | C (d_inner)], a per-head gated RMSNorm (eps 1e-5), Llama
attention with RoPE and SwiGLU MLPs after every mixer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import stree
from stree.protocols.token_tree import TokenTree
from stree.verifier.model.checkpoint import load_model
from hf_helpers import (D_INNER, D_STATE, D_XB, EPS, HD, HEADS, K, KV, NGROUPS, V, mambainllama_tiny,
                        write_mambainllama)

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _groups_to_heads(t):
    """[T, d_xb] -> [T, heads, d_state]: group g serves heads g*r .. g*r+r-1."""
    return t.reshape(t.shape[0], D_XB // D_STATE, D_STATE).repeat_interleave(D_INNER // D_XB, dim=1)


def _ref_mamba(u, w, before_conv):
    T = u.shape[0]
    z, xbc, dt = torch.split(u @ w["in_proj.weight"].T, [D_INNER, D_INNER + 2 * D_XB, NGROUPS], -1)
    if before_conv:
        x, b, c = torch.split(xbc, [D_XB, D_XB, D_INNER], -1)
        xbc = torch.cat([_groups_to_heads(x).reshape(T, -1), _groups_to_heads(b).reshape(T, -1), c], -1)
    conv = F.conv1d(F.pad(xbc.T[None], (K - 1, 0)), w["conv1d.weight"], w["conv1d.bias"], groups=xbc.shape[-1])
    xbc = F.silu(conv[0].T)
    if before_conv:
        x, b, c = (t.reshape(T, NGROUPS, D_STATE) for t in torch.split(xbc, [D_INNER] * 3, -1))
    else:
        x, b, c = torch.split(xbc, [D_XB, D_XB, D_INNER], -1)
        x, b, c = _groups_to_heads(x), _groups_to_heads(b), c.reshape(T, NGROUPS, D_STATE)
    dt = F.softplus(dt + w["dt_bias"])
    a = -torch.exp(w["A_log"])
    h = torch.zeros(NGROUPS, D_STATE, D_STATE, dtype=u.dtype)  # [heads, headdim (= d_state), d_state]
    ys = []
    for t in range(T):
        h = torch.exp(dt[t] * a)[:, None, None] * h + dt[t][:, None, None] * x[t][:, :, None] * b[t][:, None, :]
        ys.append((h * c[t][:, None, :]).sum(-1) + w["D"][:, None] * x[t])
    y = torch.stack(ys).reshape(T, D_INNER) * F.silu(z)
    y = y.reshape(T, NGROUPS, D_STATE)
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(T, D_INNER) * w["norm.weight"]
    return y @ w["out_proj.weight"].T


def _rope(x, base):
    T = x.shape[1]
    inv = 1.0 / base ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _ref_attn(u, w, base):
    T = u.shape[0]
    q = (u @ w["q_proj.weight"].T).reshape(T, HEADS, HD).transpose(0, 1)
    k = (u @ w["k_proj.weight"].T).reshape(T, KV, HD).transpose(0, 1).repeat_interleave(HEADS // KV, 0)
    v = (u @ w["v_proj.weight"].T).reshape(T, KV, HD).transpose(0, 1).repeat_interleave(HEADS // KV, 0)
    q, k = _rope(q, base), _rope(k, base)
    s = q @ k.transpose(1, 2) / math.sqrt(HD)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(T, HEADS * HD) @ w["o_proj.weight"].T


def ref_logits(cfg, mcfg, sd, ids):
    sd = {k: v.double() for k, v in sd.items()}
    before = bool(mcfg["ssm_cfg"].get("repeat_kv_before_conv", False))
    h = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sub = lambda pre: {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}  # noqa: E731
        u = _rms(h, sd[p + "input_layernorm.weight"], EPS)
        if i in mcfg["attn_layers"]:
            h = h + _ref_attn(u, sub(p + "self_attn."), cfg["rope_theta"])
        else:
            h = h + _ref_mamba(u, sub(p + "mamba."), before)
        u = _rms(h, sd[p + "post_attention_layernorm.weight"], EPS)
        mlp = sub(p + "mlp.")
        h = h + (F.silu(u @ mlp["gate_proj.weight"].T) * (u @ mlp["up_proj.weight"].T)) @ mlp["down_proj.weight"].T
    return (_rms(h, sd["model.norm.weight"], EPS) @ sd["lm_head.weight"].T).float()


def ref_greedy(tiny, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(ref_logits(*tiny, ids)[-1].argmax()))
    return ids[len(prompt):]


# ----- tests ---------------------------------------------------------------------------------------------
@pytest.fixture(params=[False, True], ids=["conv_on_d_xb", "repeat_kv_before_conv"])
def hybrid(request, tmp_path):
    tiny = mambainllama_tiny(3, [1], before_conv=request.param)
    return tiny, load_model(write_mambainllama(tmp_path / "mil", *tiny))


def test_scores_match_reference(hybrid):
    tiny, model = hybrid
    torch.manual_seed(0)
    ids = torch.randint(0, V, (12,)).tolist()
    torch.testing.assert_close(model.score_sequence(ids), ref_logits(*tiny, ids), atol=1e-4, rtol=1e-4)
    prefix = ids[:7]
    tree = TokenTree.from_parents(torch.randint(0, V, (7,)).tolist(), [-1, 0, 0, 1, 1, 2, 4])
    got = model.score_tree(prefix, tree)
    for node in range(tree.num_nodes):
        want = ref_logits(*tiny, prefix + tree.path_tokens(node))[-1]
        torch.testing.assert_close(got[node], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree", ["chain:4", "static:2,2,1", "beam:3x2"])
def test_greedy_speculation_equals_reference_greedy(hybrid, tmp_path, tree):
    tiny, model = hybrid
    draft = load_model(write_mambainllama(tmp_path / "draft", *mambainllama_tiny(1, [], seed=1)))
    torch.manual_seed(1)
    prompt = torch.randint(0, V, (6,)).tolist()
    out = stree.generate(model, prompt, drafter="mamba", draft_model=draft, max_new_tokens=12, tree=tree,
                         cuda_graphs=False)
    assert out.token_ids == ref_greedy(tiny, prompt, 12)


def test_plain_llama_and_bad_shapes_are_refused(tmp_path):
    cfg, mcfg, sd = mambainllama_tiny(2, [1])
    with pytest.raises(ValueError, match="mamba_config.json"):
        load_model(write_mambainllama(tmp_path / "plain", cfg, None, sd))
    with pytest.raises(ValueError, match="d_xb"):
        load_model(write_mambainllama(tmp_path / "bad", cfg, {**mcfg, "d_xb": 12}, sd))
    mamba1 = {k.replace("mamba.in_proj.", "mamba.in_proj_x."): v for k, v in sd.items()}
    with pytest.raises(ValueError, match="Mamba1"):
        load_model(write_mambainllama(tmp_path / "mamba1", cfg, mcfg, mamba1))
    with pytest.raises(ValueError, match="rope_type"):
        load_model(write_mambainllama(tmp_path / "rope", {**cfg, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                          mcfg, sd))
