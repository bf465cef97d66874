"""Decoding: the speculative loop (draft, tree forward, verify, commit) and lossless verification."""
