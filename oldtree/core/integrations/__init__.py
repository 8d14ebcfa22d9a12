"""Integrations with engines and model libraries (transformers, torch.library custom ops)."""
