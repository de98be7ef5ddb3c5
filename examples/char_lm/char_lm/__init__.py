"""A character-level GPT on CPython's help text: a user project for ray_app (plain PyTorch)."""
