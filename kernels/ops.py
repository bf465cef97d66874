"""The ops the model calls, each routed to its Triton kernel or its PyTorch reference (see backend.py), in the
numerics ``numerics.py`` says: ``_EXACT_OPS`` replace their ``_OPS`` entry in exact mode (the default)."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from stree.kernels import backend, norm_linear, numerics
from stree.kernels.greedy_verify import FUSED_MAX_NODES
from stree.kernels.linear import linear as fast_linear
from stree.kernels.pointwise import FUSED_ACTIVATIONS
from stree.kernels.rotary import rotary_inv_freq

# op name -> (reference "module:function", triton "module:function")
_OPS = {
    "tree_scan": ("tree_scan:tree_scan_ref", "tree_scan_triton:tree_scan_triton"),
    "tree_conv1d": ("tree_conv:tree_conv1d_ref", "tree_conv_triton:tree_conv1d_triton"),
    "tree_conv_scan": ("tree_conv_scan:tree_conv_scan_ref", "tree_conv_scan_triton:tree_conv_scan_triton"),
    "replay": ("replay:replay_ref", "replay_triton:replay_triton"),
    "replay_layers": ("replay:replay_layers_ref", "replay_triton:replay_layers_triton"),
    "mamba_step": ("mamba_step:mamba_step_ref", "mamba_step_triton:mamba_step_triton"),
    "ssd_step": ("decode_step:ssd_step_ref", "decode_step_triton:ssd_step_triton"),
    "conv_step": ("decode_step:conv_step_ref", "decode_step_triton:conv_step_triton"),
    "ssd_prefill": ("chunk_scan:ssd_prefill_ref", "chunk_scan_triton:ssd_prefill_triton"),
    "conv_prefill": ("chunk_scan:conv_prefill_ref", "chunk_scan_triton:conv_prefill_triton"),
    "tree_attention": ("tree_attention:tree_attention_ref", "tree_attention_triton:tree_attention_triton"),
    "kv_commit": ("tree_attention:kv_commit_ref", "tree_attention_triton:kv_commit_triton"),
    "greedy_verify": ("greedy_verify:greedy_verify_ref", "greedy_verify_triton:greedy_verify_triton"),
    "sampled_verify": ("sampled_verify:sampled_verify_ref", "sampled_verify_triton:sampled_verify_triton"),
    "keyed_uniform": ("keyed_random:keyed_uniform_ref", "keyed_random_triton:keyed_uniform_triton"),
    "history_append": ("history_append:history_append_ref", "history_append_triton:history_append_triton"),
    "rotary": ("rotary:rotary_ref", "rotary_triton:rotary_triton"),
    "add_rmsnorm": ("norms:add_rmsnorm_ref", "norms_triton:add_rmsnorm_triton"),
    "gated_rmsnorm": ("norms:gated_rmsnorm_ref", "norms_triton:gated_rmsnorm_triton"),
}
# op name -> (reference, triton) of the exact numerics: every row computed the same way whatever the row count,
# batch, tree shape or step
_EXACT_OPS = {
    "gemm": ("gemm:gemm_ref", "gemm_triton:gemm_triton"),
    "tree_conv_scan": ("ssm_walk:tree_conv_scan_exact_ref", "ssm_walk_triton:tree_conv_scan_exact_triton"),
    "replay": ("ssm_walk:replay_exact_ref", "replay_triton:replay_exact_triton"),
    "replay_layers": ("ssm_walk:replay_layers_exact_ref", "replay_triton:replay_layers_exact_triton"),
    "ssd_prefill": ("ssm_walk:ssd_prefill_exact_ref", "chunk_scan_triton:ssd_prefill_exact_triton"),
    "conv_prefill": ("ssm_walk:conv_prefill_exact_ref", "chunk_scan_triton:conv_prefill_triton"),
    "tree_attention": ("tree_attention_exact:tree_attention_exact_ref",
                       "tree_attention_exact_triton:tree_attention_exact_triton"),
}
_CACHE: dict[tuple[str, str, bool], object] = {}


def _ref(op: str):
    """``op``'s reference in the current numerics (what a shape the fused kernel does not take runs)."""
    return _load((_EXACT_OPS if op in _EXACT_OPS and numerics.exact() else _OPS)[op][0])


def _load(spec: str):
    mod, fn = spec.split(":")
    return getattr(importlib.import_module(f"{__package__}.{mod}"), fn)


def get(op: str, device) -> object:
    """The implementation of ``op`` for tensors on ``device`` in the current numerics."""
    which = backend.resolve(device)
    exact = op in _EXACT_OPS and numerics.exact()
    key = (op, which, exact)
    if key not in _CACHE:
        ref, tri = _EXACT_OPS[op] if exact else _OPS[op]
        if which == "triton":
            try:
                _CACHE[key] = _load(tri)
            except (ImportError, AttributeError):
                _CACHE[key] = _load(ref)  # no kernel for this op (or no triton): the reference
        else:
            _CACHE[key] = _load(ref)
    return _CACHE[key]


def tree_scan(x, dt, A, Bm, Cm, D, parents, ssm_state):
    return get("tree_scan", x.device)(x, dt, A, Bm, Cm, D, parents, ssm_state)


def tree_conv1d(xBC, conv_state, weight, bias, parents):
    return get("tree_conv1d", xBC.device)(xBC, conv_state, weight, bias, parents)


def tree_conv_scan(xBC, conv_state, conv_w, conv_b, parents, dt_raw, dt_bias, dt_limit, activation, A, D, ngroups,
                   headdim, ssm_state, is_chain: bool = False, acts_out=None):
    """The tree pass between in_proj and the gated norm (conv + activation, dt, tree scan) in one launch:
    ``(y [B, N, H, P], xbc [B, N, C] post-conv, dt [B, N, H] float32)``.

    The fused kernel takes SiLU and conv width >= 2; anything else runs the reference. ``is_chain``
    (every row of ``parents`` is ``i - 1``) lets the kernel skip the parent walk; the reference reads ``parents``.
    ``acts_out = (xbc, dt, pre)`` (optional) receive ``xbc``, ``dt`` and a copy of ``xBC``: slices of stacked
    buffers, so that the commit replays every layer in one launch (``replay_layers``). In exact numerics each node's
    SSM state is the decode step's recurrence along its path and ``D`` may be per channel (``[H * P]``).
    """
    ref = _ref("tree_conv_scan")
    op = get("tree_conv_scan", xBC.device)
    if activation not in FUSED_ACTIVATIONS or conv_w.shape[1] < 2:
        op = ref
    args = (xBC, conv_state, conv_w, conv_b, parents, dt_raw, dt_bias, dt_limit, activation, A, D, ngroups, headdim,
            ssm_state)
    if acts_out is None:
        return op(*args, is_chain=is_chain)
    xbc_out, dt_out, pre_out = acts_out
    if op is not ref:
        return op(*args, is_chain=is_chain, out=(None, xbc_out, dt_out), pre=pre_out)
    y, xbc, dt = op(*args, is_chain=is_chain)
    xbc_out.copy_(xbc)
    dt_out.copy_(dt)
    pre_out.copy_(xBC)
    return y, xbc_out, dt_out


def replay(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len):
    return get("replay", x.device)(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len)


def replay_layers(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len):
    """``replay`` of every layer of stacked ``[L, ...]`` tensors (``A`` ``[L, H]``), in one launch."""
    return get("replay_layers", x.device)(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len)


def mamba_step(conv_state, ssm_state, xBC, dt_raw, conv_w, conv_b, dt_bias, A, D, ngroups, dt_limit, activation,
               src_rows=None, new_states=None):
    """The whole decode step after in_proj (conv, activation, dt, state update, y + D x) in one launch; in place, or
    into ``new_states`` with row b stepping row ``src_rows[b]`` of the given states (``mamba_step_ref``).

    The fused kernel takes SiLU and conv width >= 2; anything else runs the reference.
    """
    op = get("mamba_step", xBC.device)
    if activation not in FUSED_ACTIVATIONS or conv_w.shape[1] < 2:
        op = _load(_OPS["mamba_step"][0])
    return op(conv_state, ssm_state, xBC, dt_raw, conv_w, conv_b, dt_bias, A, D, ngroups, dt_limit, activation,
              src_rows=src_rows, new_states=new_states)


def ssd_step(ssm_state, x, dt, A, Bm, Cm, D):
    return get("ssd_step", x.device)(ssm_state, x, dt, A, Bm, Cm, D)


def conv_step(conv_state, xBC, weight, bias):
    return get("conv_step", xBC.device)(conv_state, xBC, weight, bias)


def ssd_prefill(x, dt, A, Bm, Cm, D, ssm_state):
    return get("ssd_prefill", x.device)(x, dt, A, Bm, Cm, D, ssm_state)


def conv_prefill(xBC, conv_state, weight, bias):
    return get("conv_prefill", xBC.device)(xBC, conv_state, weight, bias)


def tree_attention(q, k_cache, v_cache, seqlen, anc_mask, softmax_scale=None, is_chain: bool = False):
    """Attention of tree nodes over the committed keys and their ancestors. ``is_chain`` (``anc_mask`` is
    lower-triangular: prefill, decode steps) lets the exact kernel share key loads between consecutive nodes."""
    op = get("tree_attention", q.device)
    if numerics.exact():
        return op(q, k_cache, v_cache, seqlen, anc_mask, softmax_scale, is_chain=is_chain)
    return op(q, k_cache, v_cache, seqlen, anc_mask, softmax_scale)


def kv_commit(k_cache, v_cache, seqlen, path, path_len):
    return get("kv_commit", k_cache.device)(k_cache, v_cache, seqlen, path, path_len)


def greedy_verify(tokens, parents, valid, best, max_depth: int, max_width: int):
    """``(path, path_len, bonus, out_tokens)`` of greedy verification; trees over ``FUSED_MAX_NODES`` nodes
    take the reference."""
    op = get("greedy_verify", tokens.device)
    if tokens.shape[1] > FUSED_MAX_NODES:
        op = _load(_OPS["greedy_verify"][0])
    return op(tokens, parents, valid, best, max_depth, max_width)


def keyed_uniform(seed: torch.Tensor, step: torch.Tensor, lane: int, n: int) -> torch.Tensor:
    """``[B, n]`` float32 uniforms in (0, 1) that depend only on each row's ``seed`` and ``step`` (``[B]`` int64),
    ``lane`` and the index (``keyed_random``)."""
    return get("keyed_uniform", seed.device)(seed, step, lane, n)


def history_append(buf, length, new, count, pad: int) -> None:
    """In place: each slot's first ``count[b]`` tokens of ``new`` appended to its history (``history_append``);
    ``count`` None: all of them."""
    get("history_append", buf.device)(buf, length, new, count, pad)


def sampled_verify(tokens, parents, valid, logits, temperature, top_k, top_p, mode, draft_probs, uniforms,
                   bonus_uniforms, max_depth: int, max_width: int, prob_dtype=torch.float32):
    """``(path, path_len, bonus, out_tokens)`` of recursive rejection sampling (greedy rows by argmax). The kernel
    takes float32 laws and trees up to ``FUSED_MAX_NODES``; top-k / top-p reach it as logits already filtered
    (``filter_logits_rows``: one pair of sorts over every node's row). The rest take the reference."""
    ref = _load(_OPS["sampled_verify"][0])
    op = get("sampled_verify", tokens.device)
    if prob_dtype != torch.float32 or tokens.shape[1] > FUSED_MAX_NODES:
        op = ref
    if op is not ref and (top_k is not None or top_p is not None):
        from stree.protocols.sampling import filter_logits_rows

        logits, top_k, top_p = filter_logits_rows(logits, temperature, top_k, top_p), None, None
    return op(tokens, parents, valid, logits, temperature, top_k, top_p, mode, draft_probs, uniforms,
              bonus_uniforms, max_depth, max_width, prob_dtype)


def rotary(x, pos, dim: int, base: float, interleaved: bool):
    """RoPE on the first ``dim`` channels of each head of ``x`` ``[B, T, H, D]`` at positions ``pos`` ``[B, T]``."""
    if dim == 0:
        return x
    return get("rotary", x.device)(x, pos, rotary_inv_freq(dim, base, x.device), interleaved)


def add_rmsnorm(x, residual, weight, eps, residual_in_fp32=True):
    return get("add_rmsnorm", x.device)(x, residual, weight, eps, residual_in_fp32)


def gated_rmsnorm(y, z, weight, group_size, eps, norm_before_gate=False):
    return get("gated_rmsnorm", y.device)(y, z, weight, group_size, eps, norm_before_gate)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for the model's projections and LM head: in exact numerics the fixed-tile GEMM (``gemm.py``),
    else the per-row-count fastest choice (``linear.py``). Training (gradients) takes ``F.linear``."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    if numerics.exact():
        return get("gemm", x.device)(x, weight, bias)
    return fast_linear(x, weight, bias)


def add_rmsnorm_linear(x, residual, norm_weight, eps, residual_in_fp32, weight, bias=None):
    """``add_rmsnorm`` then ``linear`` (a block's pre-norm and ``in_proj``): ``(y, new residual)``, in one
    launch where ``norm_linear`` measured that faster (fast numerics only)."""

    def unfused():
        h, r = add_rmsnorm(x, residual, norm_weight, eps, residual_in_fp32)
        return linear(h, weight, bias), r

    def fused():
        from stree.kernels.linear_rows_triton import add_rmsnorm_linear_rows_triton

        return add_rmsnorm_linear_rows_triton(x, residual, norm_weight, eps, residual_in_fp32, weight, bias)

    if numerics.exact():
        return unfused()
    return fused() if norm_linear.use_fused("add_rmsnorm", x, weight, fused, unfused) else unfused()


def gated_rmsnorm_linear(y, z, norm_weight, group_size, eps, norm_before_gate, weight, bias=None):
    """``gated_rmsnorm`` then ``linear`` (Mamba2's gated norm and ``out_proj``), in one launch where
    ``norm_linear`` measured that faster (fast numerics only)."""

    def unfused():
        return linear(gated_rmsnorm(y, z, norm_weight, group_size, eps, norm_before_gate), weight, bias)

    def fused():
        from stree.kernels.linear_rows_triton import gated_rmsnorm_linear_rows_triton

        return gated_rmsnorm_linear_rows_triton(y, z, norm_weight, group_size, eps, norm_before_gate, weight, bias)

    if numerics.exact():
        return unfused()
    return fused() if norm_linear.use_fused("gated_rmsnorm", y, weight, fused, unfused) else unfused()
