"""Serving the verifier: the gRPC GenerationService, its client, and the remote-drafter adapter."""
