"""Engines turn a save plan into encoded chunks (cpu: host codecs on a thread pool; gpu: nvCOMP pipelines)."""
