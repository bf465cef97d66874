"""Benchmarks: kernels, drafters, end to end, oracle, rpc; and the prompt sets they read."""
