"""Host memory a daemon gives back: glibc's malloc threshold for mmap, fixed.

glibc serves allocations from 128 KiB up with mmap, and each freed one raises that threshold to
its size (up to 32 MiB): after the first outer step every per-tensor buffer of a model (a few
MiB each) comes from the heap, whose arenas (one per thread: trainer, encoder, snapshot) keep
what was freed. The daemon fixes the threshold at 16 MiB (``mallopt(M_MMAP_THRESHOLD)``, which
also fixes the trim threshold): a model's flat buffers (whole fragments) are mapped and go back
when freed, while a training step's activations stay on the heap (at 1 MiB every step faulted
its activations in afresh: a lone `small` daemon trained at 0.7x its bare loop; trimming the
heaps every round, ``malloc_trim``, lowered no peak). Larger activations (a batch of 8 x 512
has 64 MiB of logits) are mapped either way: glibc's moving threshold stops at 32 MiB. Elsewhere
(not glibc) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MMAP_THRESHOLD", "give_back_freed_memory"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 16 << 20  # bytes: above a step's activations at 26M-150M parameters (8 MiB logits)
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own variable: a user who set it keeps their value


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def give_back_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; whether it was set
    (not where the C library is not glibc, or the user set ``MALLOC_MMAP_THRESHOLD_``).

    Args:
        threshold: allocations of this many bytes or more are mapped, and unmapped when freed.
    """
    if os.environ.get(ENV):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    if not done:
        logger.debug("mallopt(M_MMAP_THRESHOLD) refused: freed memory stays with the allocator")
    return done
