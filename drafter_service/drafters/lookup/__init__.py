"""Prompt lookup and retrieval drafting on the device: one tree rule shared with the host drafters."""
