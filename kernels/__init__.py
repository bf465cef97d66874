"""Tree-scan, tree-conv, replay, decode-step and attention ops: Triton kernels beside their PyTorch references."""
