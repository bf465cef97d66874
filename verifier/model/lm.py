"""StreeLM: a Mamba2 or hybrid Mamba2+attention language model laid out like mamba_ssm's MambaLMHeadModel.

Besides the plain forward it exposes the inference modes speculative decoding needs, all over an
explicit ``LMState``: ``prefill``, ``step``, ``tree_forward`` (every node of a tree batch in one
pass, state untouched) and ``commit`` (advance along the accepted path by activation replay).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from stree.kernels import ops, rowwise
from stree.kernels.backend import capturing
from stree.protocols.token_tree import ancestor_mask
from stree.protocols.token_tree import TokenTree, TreeBatch

from stree.verifier.model.attention import Attention
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.layer_stack import allocate_stacked, map_layers, paired_field_stacks, stacked_view
from stree.verifier.model.linear import Linear
from stree.verifier.model.mamba2_mixer import Mamba2Mixer, Projected
from stree.verifier.model.parallel_mixer import ParallelMixer
from stree.verifier.model.shared_block_mixer import SharedBlockMixer
from stree.verifier.model.token_mixers import NoLayerState, SoftmaxMoEMLP, token_mixer
from stree.verifier.model.weights_home import WeightsHome


def _norm(config: ModelConfig, dim: int) -> nn.Module:
    if config.rms_norm:
        return nn.RMSNorm(dim, eps=config.norm_epsilon)
    return nn.LayerNorm(dim, eps=config.norm_epsilon)


class GatedMLP(nn.Module):
    """mamba_ssm's GatedMLP: ``fc2(a * silu(g))`` with ``a, g = fc1(x).chunk(2)``."""

    def __init__(self, d_model: int, hidden: int, bias: bool = False):
        super().__init__()
        self.fc1 = Linear(d_model, 2 * hidden, bias=bias)
        self.fc2 = Linear(hidden, d_model, bias=bias)

    def forward(self, x):
        a, g = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(a * rowwise.silu(g))


class Block(nn.Module):
    """Pre-norm residual block: mixer (Mamba2, attention, both side by side, or a per-token MLP/MoE), then an
    optional gated MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.kind = config.layer_kind(layer_idx)
        self.is_attention = self.kind in ("attn", "parallel", "hybrid")  # holds a KV cache; prefill/step take seqlen
        # a hybrid (Zamba2) mixer takes the un-normed residual stream and the embeddings, and norms them itself
        self.norm = None if self.kind == "hybrid" else _norm(config, config.d_model)
        if self.kind == "token":
            self.mixer = token_mixer(config.d_model, config.layer_mixers[layer_idx])
        elif self.kind == "parallel":
            self.mixer = ParallelMixer(config)
        elif self.kind == "hybrid":
            self.mixer = SharedBlockMixer(config)
        else:
            self.mixer = Attention(config) if self.is_attention else Mamba2Mixer(config)
        if config.moe_mlp:
            self.norm2 = _norm(config, config.d_model)
            self.mlp = SoftmaxMoEMLP(config.d_model, config.moe_mlp)
        elif config.d_intermediate > 0:
            self.norm2 = _norm(config, config.d_model)
            self.mlp = GatedMLP(config.d_model, config.mlp_hidden, config.mlp_bias)
        else:
            self.mlp = None
        self.residual_in_fp32 = config.residual_in_fp32
        self.residual_multiplier = config.residual_multiplier
        # the pre-norm can run inside the Mamba2 mixer's in_proj launch (step and tree modes)
        self.fusable_in_proj = type(self.mixer) is Mamba2Mixer and isinstance(self.norm, nn.RMSNorm)

    def _add_norm(self, norm: nn.Module, hidden, residual):
        """Residual add + norm; RMSNorm goes through the fused op (one kernel on the GPU)."""
        if isinstance(norm, nn.RMSNorm):
            return ops.add_rmsnorm(hidden, residual, norm.weight, norm.eps, self.residual_in_fp32)
        residual = hidden if residual is None else hidden + residual
        if self.residual_in_fp32:
            residual = residual.float()
        return norm(residual.to(norm.weight.dtype)), residual

    def run(self, hidden, residual, mix, emb=None, fuse: bool = False):
        """``mix(normed)`` is the mixer call for the current mode (``mix(stream, emb)`` for a hybrid layer, which
        reads the residual stream itself and the token embeddings ``emb``). ``fuse`` (step and tree modes) lets
        a Mamba2 block hand its mixer the pre-norm already through ``in_proj`` (``ops.add_rmsnorm_linear``)."""
        if fuse and self.fusable_in_proj:
            proj = self.mixer.in_proj
            zxbcdt, residual = ops.add_rmsnorm_linear(hidden, residual, self.norm.weight, self.norm.eps,
                                                      self.residual_in_fp32, proj.weight, proj.bias)
            hidden = self._scaled(mix(Projected(zxbcdt)))
        elif self.kind == "hybrid":
            residual = hidden if residual is None else hidden + residual
            if self.residual_in_fp32:
                residual = residual.float()
            hidden = self._scaled(mix(residual.to(emb.dtype), emb))
        else:
            normed, residual = self._add_norm(self.norm, hidden, residual)
            hidden = self._scaled(mix(normed))
        if self.mlp is None:
            return hidden, residual
        normed, residual = self._add_norm(self.norm2, hidden, residual)
        return self._scaled(self.mlp(normed)), residual

    def _scaled(self, out):
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embedding = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.norm_f = _norm(config, config.d_model)


def _map_layer(layer, fn):
    """A layer state of the same type with ``fn`` applied to each of its tensors."""
    return type(layer)(**{name: fn(t) for name, t in vars(layer).items()})


@dataclass
class LMState:
    """Per-layer recurrent state and KV cache for a batch, plus tokens fed so far (``seqlen``)."""

    layers: list
    seqlen: torch.Tensor  # [B] long
    max_seqlen: int = 0
    extra: dict = field(default_factory=dict)

    def clone(self) -> "LMState":
        return LMState(map_layers(self.layers, lambda t, _: t.clone()), self.seqlen.clone(), self.max_seqlen)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the state holds (``seqlen`` first): what a step may advance."""
        return [self.seqlen] + [t for layer in self.layers for t in vars(layer).values()]

    def select(self, index: torch.Tensor) -> "LMState":
        """A new state made of the rows ``index`` (rows may repeat, e.g. to fan out a beam)."""
        return LMState(map_layers(self.layers, lambda t, dim: t.index_select(dim, index)),
                       self.seqlen[index].clone(), self.max_seqlen)

    def rows(self, n: int, start: int = 0) -> "LMState":
        """Rows ``start..start+n-1`` as views: an in-place update of the result (e.g. a prefill) updates this state."""
        end = start + n
        return LMState([_map_layer(s, lambda t: t[start:end]) for s in self.layers], self.seqlen[start:end],
                       self.max_seqlen)

    def assign_rows(self, rows: list[int], src: "LMState") -> None:
        """Overwrite rows ``rows`` with ``src``'s rows ``0..len(rows)-1`` (sequences joining a slot pool).

        A KV cache with another slot count than the pool's gives its first ``min(src, dst)`` slots; the rest are zeroed.
        """
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.seqlen.device)
        n = idx.numel()
        copied = set()  # (layer, field) pairs done as part of a stacked field: one copy for all its layers
        for name, index, view, s_view in paired_field_stacks(self.layers, src.layers):
            if view is not None and s_view.shape[2:] == view.shape[2:]:
                view.index_copy_(1, idx, s_view[:, :n].to(view.dtype))
                copied.update((i, name) for i in index)
        for i, (dst_layer, src_layer) in enumerate(zip(self.layers, src.layers)):
            for name, t in vars(dst_layer).items():
                if (i, name) in copied:
                    continue
                s = getattr(src_layer, name)[:n]
                if s.shape[1:] != t.shape[1:]:
                    fit = s.new_zeros((n, *t.shape[1:]))
                    m = min(s.shape[1], t.shape[1])
                    fit[:, :m] = s[:, :m]
                    s = fit
                t.index_copy_(0, idx, s.to(t.dtype))
        self.seqlen[idx] = src.seqlen[:n].to(self.seqlen.device)

    def copy_from(self, src: "LMState") -> None:
        """Overwrite every row with ``src`` (same layout and batch size): one copy per stacked field."""
        done = set()
        for name, index, view, s_view in paired_field_stacks(self.layers, src.layers):
            if view is not None:
                view.copy_(s_view)
                done.update((i, name) for i in index)
        for i, (dst_layer, src_layer) in enumerate(zip(self.layers, src.layers)):
            for name, t in vars(dst_layer).items():
                if (i, name) not in done:
                    t.copy_(getattr(src_layer, name))
        self.seqlen.copy_(src.seqlen)

    def assign_row(self, row: int, src: "LMState") -> None:
        """Overwrite row ``row`` with a batch-1 state ``src`` (a sequence joining a slot pool)."""
        self.assign_rows([row], src)

    @property
    def batch_size(self) -> int:
        return self.seqlen.shape[0]


@dataclass
class TrimmedHead:
    """VocabTrim: LM-head rows for a subset of tokens; every other token gets logit ``-inf``."""

    keep: torch.Tensor  # [K] token ids
    weight: torch.Tensor  # [K, d]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits with every token outside the kept set at ``-inf``."""
        out = torch.full_like(logits, float("-inf"))
        out[..., self.keep] = logits[..., self.keep]
        return out

    def logits(self, h: torch.Tensor, vocab_size: int) -> torch.Tensor:
        part = ops.linear(h, self.weight.to(h.dtype)).float()
        out = torch.full((*h.shape[:-1], vocab_size), float("-inf"), device=h.device)
        out[..., self.keep] = part
        return out


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The floating dtypes a model's weights load in and its SSM state takes, by name."""
SSM_CACHE_DTYPES = (*DTYPES, "auto")


def weights_dtype(name: str | None) -> torch.dtype | None:
    """The dtype ``name`` names in ``DTYPES`` (None stays None: the checkpoint's own); ``ValueError`` naming the
    choices otherwise."""
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass
class TreeActs:
    """What the tree pass leaves for commit: per-layer Mamba activations and the tree batch."""

    layers: list
    trees: TreeBatch


class StreeLM(WeightsHome, nn.Module):
    """Mamba2 / hybrid LM with mamba_ssm's parameter names and tree-speculation inference modes.

    ``mamba_ssm_cache_dtype`` is the SSM state's dtype in states made from now on: float32 (the default;
    every kernel computes in float32 either way) or the model's half dtype, as mamba_ssm keeps it, which
    halves the state traffic that dominates decode at large batch (vLLM's ``mamba_ssm_cache_dtype``).
    """

    mamba_ssm_cache_dtype: torch.dtype = torch.float32
    tokenizer = None  # the model folder's tokenizers.Tokenizer, set by load_model (None: the folder has none)

    def set_mamba_ssm_cache_dtype(self, name: str | torch.dtype) -> None:
        """``float32``, ``bfloat16``, ``float16`` or ``auto`` (the model's dtype), for states made afterwards."""
        dtype = ({**DTYPES, "auto": self.dtype}.get(name) if isinstance(name, str) else name)
        if dtype not in DTYPES.values():
            raise ValueError(f"mamba_ssm_cache_dtype must be one of {', '.join(SSM_CACHE_DTYPES)}; got {name!r}")
        self.mamba_ssm_cache_dtype = dtype

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        self.lm_head = Linear(config.d_model, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def _home_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def _logits(self, hidden, residual, head: "TrimmedHead | None" = None, return_hidden: bool = False):
        """Logits (and, with ``return_hidden``, the final-norm hidden states they were read from). The final
        RMSNorm runs as the LM head's prologue (one launch) where ``norm_linear`` measured that faster (fast
        numerics)."""
        norm, last = self.backbone.norm_f, self.backbone.layers[-1]
        if head is None and not return_hidden and isinstance(norm, nn.RMSNorm):
            logits, _ = ops.add_rmsnorm_linear(hidden, residual, norm.weight, norm.eps, last.residual_in_fp32,
                                               self.lm_head.weight, self.lm_head.bias)
        else:
            h, _ = last._add_norm(norm, hidden, residual)
            logits = head.logits(h, self.config.vocab_size) if head is not None else self.lm_head(h)
        if head is None:  # logits past the real vocabulary (mamba_ssm pads it to a multiple of 8) are dropped
            logits = logits[..., : self.config.vocab_size].float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return (logits, h) if return_hidden else logits

    def _run(self, input_ids, mixes, head: "TrimmedHead | None" = None, return_hidden: bool = False,
             pick: torch.Tensor | None = None, fuse: bool = False, logits: bool = True):
        """Embed, run every block, read logits; ``pick`` (``[B]`` positions) reads them at one position per row.
        ``fuse``: the mixes are step or tree calls, which take a ``Projected`` input (see ``Block.run``).
        ``logits=False``: only the blocks' side effects are wanted (a tree pass's activations), no norm or LM head."""
        hidden, residual = self.backbone.embedding(input_ids), None
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        emb = hidden  # what hybrid (Zamba2) layers concatenate to the residual stream
        for block, mix in zip(self.backbone.layers, mixes):
            hidden, residual = block.run(hidden, residual, mix, emb, fuse)
        if not logits:
            return None
        if pick is not None:  # only the picked positions go through the final norm and the LM head
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            hidden, residual = hidden[rows, pick], residual[rows, pick]
        return self._logits(hidden, residual, head, return_hidden)

    def trimmed_head(self, keep: torch.Tensor) -> "TrimmedHead":
        """An LM head restricted to token ids ``keep`` (VocabTrim), for cheaper draft steps."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device).unique()
        if keep.numel() == 0 or int(keep.min()) < 0 or int(keep.max()) >= self.vocab_size:
            raise ValueError(f"vocabulary trim ids must be a non-empty subset of [0, {self.vocab_size})")
        return TrimmedHead(keep, self.lm_head.weight.detach()[keep].clone())

    # ----- plain forward --------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, return_hidden: bool = False):
        """``[B, T]`` ids -> ``[B, T, vocab]`` float32 logits, from an empty state (and the final-norm hidden states)."""
        return self._run(input_ids, [b.mixer for b in self.backbone.layers], return_hidden=return_hidden)

    # ----- inference state ------------------------------------------------------------------
    def new_state(self, batch_size: int, max_seqlen: int) -> LMState:
        dev, dt = self.device, self.dtype
        meta = torch.device("meta")  # shapes first: each field of equal shape across layers is one stacked tensor
        layers = [
            NoLayerState() if b.kind == "token"
            else b.mixer.new_state(batch_size, max_seqlen, meta, dt) if b.is_attention
            else b.mixer.new_state(batch_size, meta, dt)
            for b in self.backbone.layers
        ]
        ssm_dtype = self.mamba_ssm_cache_dtype
        for layer in layers:
            if getattr(layer, "ssm_state", None) is not None and ssm_dtype != layer.ssm_state.dtype:
                layer.ssm_state = torch.empty(layer.ssm_state.shape, device=meta, dtype=ssm_dtype)
        return LMState(allocate_stacked(layers, dev), torch.zeros(batch_size, dtype=torch.long, device=dev),
                       max_seqlen)

    def _check_ids(self, ids: torch.Tensor) -> None:
        if capturing():
            return
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {ids.min()}..{ids.max()}")

    def _cached_mixes(self, state: LMState, mode: str, lengths: torch.Tensor | None = None,
                      source: "LMState | None" = None, rows: torch.Tensor | None = None) -> list:
        """Per layer, ``h -> y`` through its mixer's ``mode`` ("prefill" or "step") on the layer's state;
        attention also gets the tokens already in the state, token mixers (MLPs) take ``h`` alone.
        ``lengths`` (prefill only) is each row's count of real tokens in a right-padded batch. ``source`` and
        ``rows`` (steps of Mamba2 layers only): each layer steps ``source``'s rows into ``state``."""
        seqlen = state.seqlen
        kw = {} if lengths is None else {"lengths": lengths}
        sources = [None] * len(state.layers) if source is None else source.layers
        return [
            b.mixer if b.kind == "token"
            else (lambda h, e, f=getattr(b.mixer, mode), s=s: f(h, e, s, seqlen, **kw)) if b.kind == "hybrid"
            else (lambda h, f=getattr(b.mixer, mode), s=s: f(h, s, seqlen, **kw)) if b.is_attention
            else (lambda h, f=b.mixer.step, s=s, src=src: f(h, s, src, rows)) if mode == "step" and type(b.mixer) is Mamba2Mixer
            else (lambda h, f=getattr(b.mixer, mode), s=s: f(h, s, **kw))
            for b, s, src in zip(self.backbone.layers, state.layers, sources)
        ]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, state: LMState, return_hidden: bool = False):
        """Feed ``[B, T]`` tokens after the state's; returns their logits ``[B, T, V]`` (and hidden ``[B, T, d]``)."""
        self._check_ids(input_ids)
        out = self._run(input_ids, self._cached_mixes(state, "prefill"), return_hidden=return_hidden)
        state.seqlen += input_ids.shape[1]
        return out

    @torch.no_grad()
    def prefill_padded(self, input_ids: torch.Tensor, lengths: torch.Tensor, state: LMState,
                       return_hidden: bool = False):
        """Feed row b its first ``lengths[b]`` tokens of ``[B, T]`` ``input_ids`` (the rest is padding) in one pass;
        the state's rows advance by ``lengths``, exactly as a per-row ``prefill`` of the real tokens would.

        Returns ``[B, V]`` float32 logits at each row's last real token (and, with ``return_hidden``, the
        final-norm hidden ``[B, d]`` there); only those positions reach the LM head.
        """
        self._check_ids(input_ids)
        b, t = input_ids.shape
        if not capturing() and (lengths.shape != (b,) or lengths.dtype != torch.long
                                or (b > 0 and (int(lengths.min()) < 1 or int(lengths.max()) > t))):
            raise ValueError(f"prefill_padded: lengths must be a [{b}] long tensor with values in 1..{t}; got "
                             f"{lengths.dtype} {tuple(lengths.shape)} {lengths.tolist()}")
        out = self._run(input_ids, self._cached_mixes(state, "prefill", lengths), return_hidden=return_hidden,
                        pick=lengths - 1)
        state.seqlen += lengths
        return out

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, state: LMState, head: "TrimmedHead | None" = None,
             return_hidden: bool = False, *, source: "LMState | None" = None,
             source_rows: torch.Tensor | None = None):
        """Feed one token per sequence (``[B]``); returns ``[B, V]`` logits (``-inf`` outside a trimmed ``head``).

        With ``return_hidden`` it returns ``(logits, hidden [B, d])``, the final-norm hidden states.
        With ``source`` (another state of this model, only read; pure Mamba2 models), row b continues from
        ``source``'s row ``source_rows[b]`` (row b without ``source_rows``) and the stepped row goes to ``state``:
        beams follow their parents with no copy of the state.
        """
        if source is not None:
            self._check_source(state, source, source_rows)
        out = self._run(input_ids, self._cached_mixes(state, "step", source=source, rows=source_rows), head,
                        return_hidden, fuse=True)
        if source is None:
            state.seqlen += 1
        else:
            picked = source.seqlen if source_rows is None else source.seqlen.index_select(0, source_rows)
            torch.add(picked, 1, out=state.seqlen)
        return out

    def _check_source(self, state: LMState, source: LMState, rows: torch.Tensor | None) -> None:
        """``step``'s ``source`` must be another state of this pure Mamba2 model and ``rows`` must name its rows
        (values checked outside graph capture)."""
        if any(b.kind != "token" and type(b.mixer) is not Mamba2Mixer for b in self.backbone.layers):
            raise ValueError("step: stepping from another state's rows needs a model of Mamba2 (and MLP) layers only")
        if source is state or len(source.layers) != len(state.layers):
            raise ValueError("step: source must be another state of this model")
        if rows is None:
            if source.batch_size != state.batch_size:
                raise ValueError(f"step: source has {source.batch_size} rows, state {state.batch_size}: "
                                 "pass source_rows")
        elif rows.shape != (state.batch_size,) or rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"step: source_rows must be [{state.batch_size}] integers, got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        elif not capturing() and (int(rows.min()) < 0 or int(rows.max()) >= source.batch_size):
            raise ValueError(f"step: source_rows must name rows 0..{source.batch_size - 1} of source")

    @torch.no_grad()
    def tree_forward(self, trees: TreeBatch, state: LMState, anc_mask: torch.Tensor | None = None,
                     return_hidden: bool = False, acts_only: bool = False):
        """Logits ``[B, N, V]`` after every node of each tree, in one pass; ``state`` is unchanged.

        ``anc_mask`` (``[B, N, N]``, optional) saves recomputing the ancestor mask on the device.
        With ``return_hidden`` it returns ``(logits, acts, hidden [B, N, d])``, the final-norm hidden states.
        ``acts_only``: a pass whose logits nobody reads (a draft's last pass, a catch-up) skips the final norm and
        the LM head and returns ``(None, acts)``.
        """
        trees = trees.to(self.device)
        self._check_ids(trees.tokens)
        parents, depth = trees.parents, trees.depth
        anc = None
        if any(b.is_attention for b in self.backbone.layers):
            anc = anc_mask.to(self.device) if anc_mask is not None else ancestor_mask(parents)
        seqlen = state.seqlen
        acts: list = []
        stacked = self._stacked_acts(*trees.tokens.shape)

        def mamba_mix(h, b, s):
            out = None if stacked is None else tuple(t[stacked[0][id(b)]] for t in stacked[1:])
            y, a = b.mixer.tree(h, s, parents, is_chain=trees.is_chain, acts_out=out)
            acts.append(a)
            return y

        def attn_mix(h, b, s):
            acts.append(None)
            return b.mixer.tree(h, s, seqlen, depth, anc)

        def parallel_mix(h, b, s):
            y, a = b.mixer.tree(h, s, seqlen, depth, anc, parents)
            acts.append(a)
            return y

        def hybrid_mix(h, e, b, s):
            y, a = b.mixer.tree(h, e, s, seqlen, depth, anc, parents)
            acts.append(a)
            return y

        def token_mix(h, b):
            acts.append(None)
            return b.mixer(h)

        mixes = [
            (lambda h, b=b: token_mix(h, b)) if b.kind == "token"
            else (lambda h, b=b, s=s: parallel_mix(h, b, s)) if b.kind == "parallel"
            else (lambda h, e, b=b, s=s: hybrid_mix(h, e, b, s)) if b.kind == "hybrid"
            else (lambda h, b=b, s=s: attn_mix(h, b, s)) if b.is_attention
            else (lambda h, b=b, s=s: mamba_mix(h, b, s))
            for b, s in zip(self.backbone.layers, state.layers)
        ]
        if return_hidden:
            logits, hidden = self._run(trees.tokens, mixes, return_hidden=True, fuse=True)
            return logits, TreeActs(acts, trees), hidden
        logits = self._run(trees.tokens, mixes, fuse=True, logits=not acts_only)
        return logits, TreeActs(acts, trees)

    def _mamba_blocks(self) -> list:
        return [b for b in self.backbone.layers if b.kind == "mamba"]

    def _stacked_acts(self, batch: int, nodes: int):
        """Stacked ``[L, B, N, ...]`` buffers the Mamba2 layers' tree passes write the commit's activations to
        (post-conv xbc, dt, pre-conv xBC), with each block's row: ``(rows, xbc, dt, xBC)``; None for fewer
        than two Mamba2 layers or layers of different sizes."""
        blocks = self._mamba_blocks()
        if len(blocks) < 2 or len({(b.mixer.conv_dim, b.mixer.nheads) for b in blocks}) > 1:
            return None
        m, n_layers, dev = blocks[0].mixer, len(blocks), self.device
        return ({id(b): j for j, b in enumerate(blocks)},
                torch.empty(n_layers, batch, nodes, m.conv_dim, device=dev, dtype=self.dtype),
                torch.empty(n_layers, batch, nodes, m.nheads, device=dev, dtype=torch.float32),
                torch.empty(n_layers, batch, nodes, m.conv_dim, device=dev, dtype=self.dtype))

    def _A_stack(self, blocks) -> torch.Tensor:
        """Every Mamba2 layer's ``A`` as one ``[L, H]`` tensor, rebuilt only when some layer's ``A`` changed."""
        parts = [b.mixer._A() for b in blocks]
        cached = getattr(self, "_A_stack_cache", None)
        if cached is None or len(cached[0]) != len(parts) or any(p is not q for p, q in zip(parts, cached[0])):
            cached = (parts, torch.stack(parts))
            self._A_stack_cache = cached
        return cached[1]

    def _commit_stacked(self, state: LMState, acts: TreeActs, path, path_len) -> bool:
        """Replay every Mamba2 layer in one launch when their states and activations are stacked views."""
        pairs = [(b, s, a) for b, s, a in zip(self.backbone.layers, state.layers, acts.layers) if b.kind == "mamba"]
        if len(pairs) < 2 or any(a is None for _, _, a in pairs):
            return False
        states, layer_acts = [s for _, s, _ in pairs], [a for _, _, a in pairs]
        views = ([stacked_view([getattr(s, name) for s in states]) for name in ("ssm_state", "conv_state")]
                 + [stacked_view([getattr(a, name) for a in layer_acts]) for name in ("x", "dt", "Bm", "xBC")])
        if any(v is None for v in views):
            return False
        ssm, conv, x, dt, Bm, xBC = views
        ops.replay_layers(ssm, conv, x, dt, self._A_stack([b for b, _, _ in pairs]), Bm, xBC, path, path_len)
        return True

    @torch.no_grad()
    def commit(self, state: LMState, acts: TreeActs, path: torch.Tensor, path_len: torch.Tensor,
               min_len: int = 1) -> None:
        """Advance ``state`` along ``path`` (``[B, M]`` node ids, root first; ``path_len`` ``[B]``).

        ``min_len=0`` lets rows feed nothing (a catch-up pass where some slots have no backlog).
        """
        path = path.to(self.device)
        path_len = path_len.to(self.device)
        if not capturing() and bool((path_len < min_len).any()):
            raise ValueError("commit: every path must contain at least the root")
        mamba_done = self._commit_stacked(state, acts, path, path_len)
        for block, s, a in zip(self.backbone.layers, state.layers, acts.layers):
            if block.kind in ("parallel", "hybrid"):
                block.mixer.commit(s, a, state.seqlen, path, path_len)
            elif block.is_attention:
                block.mixer.commit(s, state.seqlen, path, path_len)
            elif block.kind == "mamba" and not mamba_done:
                block.mixer.commit(s, a, path, path_len)
        state.seqlen += path_len

    # ----- batch-1 conveniences -------------------------------------------------------------
    @torch.no_grad()
    def score_sequence(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, V]`` logits, by prefill from an empty state."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        state = self.new_state(1, ids.shape[1])
        return self.prefill(ids, state)[0]

    @torch.no_grad()
    def score_tree(self, prefix_ids: torch.Tensor, tree: TokenTree) -> torch.Tensor:
        """``[N, V]`` logits after each node of ``tree``, whose root comes right after ``prefix_ids``."""
        tree.check_vocab(self.vocab_size)
        prefix = torch.as_tensor(prefix_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        state = self.new_state(1, prefix.shape[1] + tree.num_nodes)
        if prefix.shape[1]:
            self.prefill(prefix, state)
        logits, _ = self.tree_forward(TreeBatch.from_trees([tree]), state)
        return logits[0]
