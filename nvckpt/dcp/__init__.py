"""nvckpt as the storage of torch.distributed.checkpoint (DCP): one compressed nvckpt file per rank.

::

    import torch.distributed.checkpoint as dcp
    import nvckpt.dcp

    dcp.save(state, storage_writer=nvckpt.dcp.Writer("ckpt/step-100"))
    dcp.load(state, storage_reader=nvckpt.dcp.Reader("ckpt/step-100"))   # any world size or sharding
    dcp.async_save(state, storage_writer=nvckpt.dcp.Writer(path), async_stager=nvckpt.dcp.Stager())

The directory layout is nvckpt.sharded.layout's; ``nvckpt info | ls | verify DIR``,
``nvckpt merge`` / ``split`` and ``convert`` work on it.  Importing this
package loads no torch until ``Writer``, ``Reader`` or ``Stager`` is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:  # what _LAZY imports on first use, for type checkers and the API reference
    from .reader import Reader
    from .stager import Stager
    from .writer import Writer

_LAZY = {"Writer": "writer", "Reader": "reader", "Stager": "stager"}

__all__ = ["Writer", "Reader", "Stager"]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
