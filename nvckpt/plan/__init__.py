"""Plan a save: walk the object (walk), find shared storage and derived tensors (derived), cut chunks (chunking)."""
