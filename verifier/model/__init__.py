"""The target model: config, checkpoints, the Mamba2/hybrid LM with its tree forward and replay, CUDA graphs."""
