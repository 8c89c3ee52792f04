"""The sharded checkpoint directory (one nvckpt file per rank, a manifest, the front-end's metadata), apart
from any front-end: its layout and manifest (``layout``, torch-free), the transaction that publishes a
directory whole over an ``nvckpt.io.directory.Directory`` (``transaction``), and the assembly of its shards
into one state (``assemble``).  ``nvckpt.dcp`` is the torch.distributed.checkpoint adapter over it; another
front-end (Megatron-Core's sharded strategies) is one more adapter."""
