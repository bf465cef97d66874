"""Hugging Face checkpoint families: map each supported ``model_type`` onto StreeLM's config and weight names."""
