"""The read layer (SPEC 15.1), below the engines and torch-free: a file's index and pipelines, its chunks
read through a ``ByteSource``, every chunk's checksum verified in one place before any decoder sees its
bytes, and host decoding.  The CPU loader, the GPU loader and the CLI tools all read through it."""
