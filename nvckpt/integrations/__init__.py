"""Integrations with training frameworks: ``lightning`` (a CheckpointIO plugin) and ``accelerate`` (save/load
hooks for Hugging Face Accelerate).  Each imports its framework only when imported itself."""
