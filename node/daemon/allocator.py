"""Host memory a daemon gives back: glibc's malloc threshold for mmap, fixed.

glibc serves allocations from 128 KiB up with mmap, and each freed one raises that threshold to
its size (up to 32 MiB): after the first outer step every per-tensor buffer of a model (a few
MiB each) comes from the heap, whose arenas (one per thread: trainer, encoder, snapshot) keep
what was freed. A daemon allocates such buffers on three threads at every round; a lone `small`
daemon's peak RSS was 2.07 GiB with the moving threshold and 1.67-1.71 GiB with it fixed at
1 MiB (bench/scale.py; docs/SCALE.md). Fixing it (``mallopt(M_MMAP_THRESHOLD)``) also fixes the
trim threshold, so freed heap memory goes back as well. Elsewhere (not glibc) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MMAP_THRESHOLD", "give_back_freed_memory"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 1 << 20  # bytes: what a model's tensors and buffers are, activations included
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own variable: a user who set it keeps their value


def give_back_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; whether it was set
    (not where the C library is not glibc, or the user set ``MALLOC_MMAP_THRESHOLD_``).

    Args:
        threshold: allocations of this many bytes or more are mapped, and unmapped when freed.
    """
    if os.environ.get(ENV):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    if not done:
        logger.debug("mallopt(M_MMAP_THRESHOLD) refused: freed memory stays with the allocator")
    return done
