"""Tree conv + dt + tree scan of a Mamba2 layer as one op (reference: ``tree_conv_scan_ref``).

Between in_proj and the gated norm the tree pass runs the tree conv (+SiLU), dt and the tree scan;
on the GPU these are one launch (``tree_conv_scan_triton``) because the model is launch-bound. The
reference is their composition: ``tree_conv_dt_ref`` then ``tree_scan_ref`` on the split activations.
"""

from __future__ import annotations

import torch

from stree.kernels.tree_conv import tree_conv_dt_ref
from stree.kernels.tree_scan import tree_scan_ref


def split_xbc(xbc: torch.Tensor, ngroups: int, headdim: int, d_state: int):
    """Views ``(x [B, N, H, P], B [B, N, G, S], C [B, N, G, S])`` of post-conv ``xbc`` ``[B, N, C]``."""
    gs = ngroups * d_state
    x, Bm, Cm = torch.split(xbc, [xbc.shape[-1] - 2 * gs, gs, gs], dim=-1)
    lead = xbc.shape[:-1]
    return (x.reshape(*lead, -1, headdim), Bm.reshape(*lead, ngroups, d_state),
            Cm.reshape(*lead, ngroups, d_state))


def tree_conv_scan_ref(xBC, conv_state, conv_w, conv_b, parents, dt_raw, dt_bias, dt_limit, activation,
                       A, D, ngroups: int, headdim: int, ssm_state, is_chain: bool = False):
    """``(y [B, N, H, P] in xBC's dtype, xbc [B, N, C] post-conv activations, dt [B, N, H] float32)``.

    ``xBC`` ``[B, N, C]`` holds the pre-conv x, B, C channels of every node (``C = H P + 2 G S``),
    ``conv_state`` ``[B, C, K-1]`` and ``ssm_state`` ``[B, H, P, S]`` the committed states (read only),
    ``D`` ``[H]`` the per-head skip. ``is_chain`` is the kernel's hint; the reference always reads ``parents``.
    """
    xbc, dt = tree_conv_dt_ref(xBC, conv_state, conv_w, conv_b, parents, dt_raw, dt_bias, dt_limit, activation)
    x, Bm, Cm = split_xbc(xbc, ngroups, headdim, ssm_state.shape[-1])
    return tree_scan_ref(x, dt, A, Bm, Cm, D, parents, ssm_state), xbc, dt
