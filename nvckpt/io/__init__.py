"""Bytes in and out: positional and O_DIRECT reads, the block-writing sink, the one atomic replace."""
