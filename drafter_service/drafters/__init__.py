"""Drafter plugins: the draft model (mamba), n-gram, retrieval, fusion and the oracle."""
