"""Sessions: one save (plan -> engine -> frame writer -> sink -> publish) and one open file (Checkpoint)."""
