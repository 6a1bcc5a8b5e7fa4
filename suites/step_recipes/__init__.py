"""Recipes written the way a new user writes them, outside ringcheck's own package: a plain-torch
decoder (`user_plain`) and a transformers Llama (`user_hf`), each with what the built-in recipes
declare left out (no padding, no `loss_dtype`, no `logits` hook, no `vocab_size`) and a model
that checkpoints with `use_reentrant=True` (issue 42, item 7)."""
