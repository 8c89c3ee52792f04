"""nvckpt's own threads leave the process's termination signals to the main thread.

Linux gives a process-wide signal (SIGTERM from SLURM or Kubernetes, SIGINT) to any one of its threads
that does not block it.  Python runs the handler in the main thread only, at its next bytecode: when the
kernel picks a save's thread, a main thread waiting in C (``time.sleep``, a blocking read) sleeps on, and
nvckpt's SIGTERM grace starts only when it wakes (seen: a minute late, after the save had ended).
Blocking these signals in every thread nvckpt starts keeps them for the main thread, whose wait is then
interrupted at once.  A thread inherits its creator's mask, so the threads these start inherit it too.
"""

from __future__ import annotations

import signal
import threading

_TERMINATION = frozenset(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None)) if s)


def leave_to_main_thread() -> None:
    """Block SIGTERM and SIGINT in the calling thread (one of nvckpt's; never the main thread)."""
    block = getattr(signal, "pthread_sigmask", None)  # absent on Windows, whose signals work otherwise
    if block is not None and _TERMINATION and threading.current_thread() is not threading.main_thread():
        block(signal.SIG_BLOCK, _TERMINATION)
