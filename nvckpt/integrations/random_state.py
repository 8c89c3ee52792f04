"""A process's random number generators' states as values nvckpt stores, and back (no pickle).

Python's ``random.getstate()`` is a tuple of ints and stores as it is; NumPy's legacy ``get_state()`` holds its
MT19937 key as a uint32 array, stored here as a uint32 tensor (``torch.from_numpy``) and made an array again
on the way back; torch's states are uint8 tensors already.  The framework integrations keep each framework's
own keys around these values (Accelerate's "numpy_random_seed", transformers' "numpy").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def numpy_state() -> tuple:
    """``np.random.get_state()`` with its key as a tensor."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return (str(name), torch.from_numpy(np.array(key, dtype=np.uint32)), int(pos), int(has_gauss), float(gauss))


def set_numpy_state(state: Any) -> None:
    """``np.random.set_state`` from what numpy_state() gave (a tuple or a list, its key a tensor or an array)."""
    name, key, pos, has_gauss, gauss = state
    key = key.cpu().numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    np.random.set_state((name, key.astype(np.uint32, copy=False), int(pos), int(has_gauss), float(gauss)))


__all__ = ["numpy_state", "set_numpy_state"]
