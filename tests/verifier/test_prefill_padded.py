"""Right-padded batched prefill equals per-row prefill: logits at each row's last real token, every state tensor,
seqlen and the next step, on Mamba2, hybrid, parallel (Falcon-H1-like) and shared-block (Zamba2-like) models."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from stree.kernels import backend  # noqa: E402
from stree.verifier.model.checkpoint import init_model, load_model, random_init_  # noqa: E402
from stree.verifier.model.config import ModelConfig  # noqa: E402
from stree.verifier.model.lm import StreeLM  # noqa: E402

V = 64
ATOL = 1e-4
SSM = dict(d_state=8, headdim=8)


def _perturb(model: StreeLM, seed: int) -> StreeLM:
    """Non-constant norms, D, conv and projection biases (random_init_ leaves them at 1 or 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".D") or "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            elif name.endswith("bias") and "dt_bias" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _config_model(seed: int, **kw) -> StreeLM:
    return _perturb(random_init_(StreeLM(ModelConfig(d_model=32, vocab_size=V, **kw)), seed), seed)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded")
    attn = dict(num_heads=4, num_heads_kv=2, head_dim=8, rotary_emb_dim=8)
    return {
        "mamba2": load_model(init_model(root / "m4", d_model=32, n_layer=2, vocab_size=V, seed=1, **SSM)),
        "mamba2_k2": load_model(init_model(root / "m2", d_model=32, n_layer=2, vocab_size=V, seed=2, d_conv=2,
                                           **SSM)),
        "hybrid": load_model(init_model(root / "h", arch="hybrid", d_model=32, n_layer=3, attn_layers=[1],
                                        vocab_size=V, seed=3, d_intermediate=48, num_heads_kv=1, **SSM)),
        "parallel": _config_model(4, n_layer=2, ssm_cfg=dict(d_conv=2, **SSM), attn_layer_idx=[0, 1],
                                  attn_cfg=attn, parallel_mamba=True, d_intermediate=40),
        "shared": _config_model(5, n_layer=4, ssm_cfg=dict(SSM), hybrid_layer_idx=[1, 3],
                                hybrid_mlp={"hidden": 40, "act": "gelu"}, attn_cfg=dict(attn, head_dim=16),
                                layer_mixers={2: {"kind": "mlp", "hidden": 40, "act": "relu2"}}),
        "conv1": _config_model(6, n_layer=2, ssm_cfg=dict(d_conv=1, **SSM), attn_layer_idx=[1], attn_cfg=attn),
    }


def _states_equal(got, row: int, want) -> None:
    """Row ``row`` of ``got`` equals the batch-1 state ``want``: seqlen, conv/SSM state, KV slots below seqlen."""
    n = int(want.seqlen[0])
    assert int(got.seqlen[row]) == n
    for lg, lw in zip(got.layers, want.layers):
        for name, t in vars(lw).items():
            g, t = getattr(lg, name)[row], t[0]
            if name in ("k_cache", "v_cache"):
                g, t = g[:n], t[:n]
            torch.testing.assert_close(g, t, atol=ATOL, rtol=1e-4, msg=f"row {row} {name}")


def _per_row(model, ids, lengths, prefixes, cap):
    """Reference: each row's prefix and then its real tokens through plain ``prefill`` on a batch-1 state;
    returns the last logits ``[B, V]``, final-norm hidden ``[B, d]`` and the batch-1 states."""
    states, logits, hidden = [], [], []
    for b, p in enumerate(prefixes):
        s = model.new_state(1, cap)
        if len(p):
            model.prefill(torch.tensor([p]), s)
        lg, h = model.prefill(ids[b:b + 1, : int(lengths[b])], s, return_hidden=True)
        logits.append(lg[0, -1])
        hidden.append(h[0, -1])
        states.append(s)
    return torch.stack(logits), torch.stack(hidden), states


def _check_padded(model, lengths: list[int], prefix_lens: list[int], seed: int, kernels: str | None = None) -> None:
    """Per-row prefill and step (default kernels) against one padded prefill and a batched step (``kernels``)."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.randint(0, V, (b, t), generator=g)
    nxt = torch.randint(0, V, (b,), generator=g)
    prefixes = [torch.randint(0, V, (n,), generator=g).tolist() for n in prefix_lens]
    lengths = torch.tensor(lengths)
    # exactly enough slots for the longest row plus one step: padding of shorter rows reaches past the cache
    cap = max(p + int(n) for p, n in zip(prefix_lens, lengths)) + 1
    want, want_hidden, singles = _per_row(model, ids, lengths, prefixes, cap)

    state = model.new_state(b, cap)
    for row, p in enumerate(prefixes):  # the same prefixes, then one padded prefill of every row
        if len(p):
            one = model.new_state(1, cap)
            model.prefill(torch.tensor([p]), one)
            state.assign_row(row, one)
    backend.use(kernels)
    try:
        got, hidden = model.prefill_padded(ids, lengths, state, return_hidden=True)
        assert got.shape == (b, V) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(hidden, want_hidden, atol=ATOL, rtol=1e-4)
        for row, s in enumerate(singles):
            _states_equal(state, row, s)
        step = model.step(nxt, state)
    finally:
        backend.use(None)
    for row, s in enumerate(singles):
        torch.testing.assert_close(step[row], model.step(nxt[row:row + 1], s)[0], atol=ATOL, rtol=1e-4)
        _states_equal(state, row, s)


ARCHS = ["mamba2", "mamba2_k2", "hybrid", "parallel", "shared", "conv1"]


@pytest.mark.parametrize("arch", ARCHS)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=6, deadline=None)
def test_padded_prefill_equals_per_row_prefill(models, arch, data, seed):
    b = data.draw(st.integers(1, 4), label="batch")
    lengths = data.draw(st.lists(st.integers(1, 9), min_size=b, max_size=b), label="lengths")
    prefix_lens = data.draw(st.lists(st.integers(0, 4), min_size=b, max_size=b), label="prefix_lens")
    _check_padded(models[arch], lengths, prefix_lens, seed)


@pytest.mark.parametrize("arch", ARCHS)
def test_fixed_edge_cases(models, arch):
    """Length 1, lengths below d_conv - 1, equal lengths, and a long prompt over a chunk of the SSD scan."""
    model = models[arch]
    _check_padded(model, [1, 2, 7, 1], [0, 0, 0, 3], seed=0)
    _check_padded(model, [5, 5, 5], [2, 0, 1], seed=1)
    _check_padded(model, [70, 3], [0, 2], seed=2)


@pytest.mark.parametrize("arch", ["hybrid", "shared"])
def test_chunked_padded_prefill_on_row_views(models, arch):
    """Rows sorted by length, descending; each chunk feeds only the still-active prefix through ``state.rows``."""
    model = models[arch]
    lengths = torch.tensor([11, 8, 5, 3, 1])
    b, t, chunk = len(lengths), int(lengths.max()), 4
    ids = torch.randint(0, V, (b, t))
    want, _, singles = _per_row(model, ids, lengths, [[]] * b, t)
    state = model.new_state(b, t)
    got = torch.empty(b, V)
    for start in range(0, t, chunk):
        active = int((lengths > start).sum())
        n = (lengths[:active] - start).clamp(max=chunk)
        logits = model.prefill_padded(ids[:active, start:start + int(n.max())], n, state.rows(active))
        done = lengths[:active] - start <= chunk
        got[:active][done] = logits[done]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    for row, s in enumerate(singles):
        _states_equal(state, row, s)


def test_bad_lengths_raise(models):
    model = models["mamba2"]
    ids = torch.zeros(2, 4, dtype=torch.long)
    for bad in (torch.tensor([0, 2]), torch.tensor([5, 2]), torch.tensor([2]), torch.tensor([2, 2], dtype=torch.int32)):
        with pytest.raises(ValueError, match="lengths"):
            model.prefill_padded(ids, bad, model.new_state(2, 8))
    with pytest.raises(ValueError, match="KV cache"):
        models["hybrid"].prefill_padded(ids, torch.tensor([4, 2]), models["hybrid"].new_state(2, 3))


def test_assign_rows_and_rows_views(models):
    model = models["hybrid"]
    src = model.new_state(2, 5)
    model.prefill_padded(torch.randint(0, V, (2, 4)), torch.tensor([4, 2]), src)
    for cap in (3, 5, 8):  # a pool with fewer, as many and more KV slots than the source
        dst = model.new_state(3, cap)
        for layer in dst.layers:
            for t in vars(layer).values():
                t.fill_(7.0)
        dst.assign_rows([2, 0], src)
        assert dst.seqlen.tolist() == [2, 0, 4]
        for dst_row, src_row in ((2, 0), (0, 1)):
            for ld, ls in zip(dst.layers, src.layers):
                for name, t in vars(ld).items():
                    s = getattr(ls, name)[src_row]
                    if name in ("k_cache", "v_cache"):
                        m = min(cap, 5)
                        assert torch.equal(t[dst_row, :m], s[:m]) and not t[dst_row, m:].any()
                    else:
                        assert torch.equal(t[dst_row], s)
        assert all((t[1] == 7.0).all() for layer in dst.layers for t in vars(layer).values())
    view = src.rows(1)
    assert view.batch_size == 1 and view.seqlen.data_ptr() == src.seqlen.data_ptr()
    assert all(getattr(lv, n).data_ptr() == t.data_ptr() for lv, ls in zip(view.layers, src.layers)
               for n, t in vars(ls).items())


def test_padded_prefill_through_triton_kernels(models):
    """The Triton conv/SSD/attention kernels (interpreted on the CPU) take padded rows exactly too."""
    pytest.importorskip("triton")
    _check_padded(models["hybrid"], [5, 1, 3], [0, 2, 0], seed=3, kernels="triton")
