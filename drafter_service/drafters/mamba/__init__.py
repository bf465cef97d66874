"""The draft-model drafter: chain, static, beam and dynamic trees grown by a small Mamba2."""
