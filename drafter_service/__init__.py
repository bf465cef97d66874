"""Drafter plugins (draft model, n-gram, retrieval, fusion), their Ray actors and the gRPC drafter service."""
