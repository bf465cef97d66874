"""A norm fused into the projection after it (``ops.add_rmsnorm_linear``, ``ops.gated_rmsnorm_linear``; fast
numerics only, which these tests run in): the ops equal their references, and a whole model's step and tree pass
through the fused launches equal the reference backend (CPU interpreter, fp32)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import on_each_backend  # noqa: E402
from stree import TreeBatch  # noqa: E402
from stree.bench.launches import count_launches  # noqa: E402
from stree.kernels import numerics, ops  # noqa: E402
from stree.kernels.norm_linear import add_rmsnorm_linear_ref, gated_rmsnorm_linear_ref  # noqa: E402


@pytest.fixture(autouse=True)
def _fast_numerics():
    numerics.use("fast")
    yield
    numerics.use(None)


def test_ops_on_the_reference_backend_are_the_references():
    x, r, nw, w = torch.randn(3, 24), torch.randn(3, 24), torch.rand(24), torch.randn(10, 24)
    y, r_out = ops.add_rmsnorm_linear(x, r, nw, 1e-5, True, w)
    y0, r0 = add_rmsnorm_linear_ref(x, r, nw, 1e-5, True, w)
    assert torch.equal(y, y0) and torch.equal(r_out, r0)
    z = torch.randn(3, 24)
    assert torch.equal(ops.gated_rmsnorm_linear(x, z, nw, 12, 1e-5, False, w),
                       gated_rmsnorm_linear_ref(x, z, nw, 12, 1e-5, False, w))


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_model_step_and_tree_through_fused_norms_equal_reference(models, arch):
    """Mamba2 blocks hand their mixer ``in_proj`` output (pre-norm fused in) and run the gated norm inside
    ``out_proj``'s launch; logits, tree activations and the stepped state match the reference backend."""
    model = models[arch]
    mamba_blocks = sum(b.fusable_in_proj for b in model.backbone.layers)
    assert mamba_blocks > 0
    prompt = torch.randint(0, model.vocab_size, (2, 7))
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 3]])
    tokens = torch.randint(0, model.vocab_size, (2, 5))
    depth = torch.tensor([[0, 1, 1, 2, 2], [0, 1, 2, 2, 3]])
    trees = TreeBatch(tokens, parents, depth, torch.tensor([5, 5]))
    step_tok = torch.randint(0, model.vocab_size, (2,))

    def run():
        state = model.new_state(2, 32)
        model.prefill(prompt, state)
        with count_launches() as counts:
            logits, acts = model.tree_forward(trees, state)
        return logits, acts, model.step(step_tok, state), state, counts

    out = on_each_backend(run)
    ref, fused = out["torch"], out["triton"]
    torch.testing.assert_close(fused[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused[2], ref[2], atol=1e-4, rtol=1e-4)
    for a, b in zip(fused[1].layers, ref[1].layers):
        if a is not None and hasattr(a, "xBC"):
            torch.testing.assert_close(a.xBC, b.xBC, atol=1e-4, rtol=1e-4)
    for a, b in zip(fused[3].layers, ref[3].layers):
        if hasattr(a, "ssm_state"):
            torch.testing.assert_close(a.ssm_state, b.ssm_state, atol=1e-4, rtol=1e-4)
    counts = fused[4]
    assert counts["triton._gated_rmsnorm_kernel"] == 0  # every Mamba2 block's gated norm ran inside out_proj
    # the pre-norms left: the blocks that are not plain Mamba2 blocks (the final norm runs inside the LM head)
    others = sum(b.norm is not None and not b.fusable_in_proj for b in model.backbone.layers)
    assert counts["triton._add_rmsnorm_kernel"] == others
    assert counts["triton._linear_rows_kernel"] >= 2 * mamba_blocks + 1
