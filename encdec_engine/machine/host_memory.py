"""Freed CPU memory stays in the process for the next step's tensors (glibc malloc).

glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mmap and
unmaps it at free, so each large tensor a step makes (a Marian step's 256 x 58,101 logits are
59 MB; an encoder batch's activations hundreds) comes back zeroed and untouched: the kernel
faults in and clears every 4 KB page again, step after step. On the 2-core AVX-512 EPYC a
log_softmax over those logits took 17.4 ms in a fresh tensor against 3.6 ms in reused memory,
and the whole Marian-base 256-request run (bench_text.py's workload, int8) 16.2 s against 11.6 s.

`keep_freed_memory` turns mmap off for the heap (`M_MMAP_MAX` = 0) and never trims its top
(`M_TRIM_THRESHOLD`), the caching that jemalloc and tcmalloc give torch users who preload them.
The price is the usual one of a caching allocator: the process keeps its peak working memory after
the peak is over, plus what fragments (a loop that makes and frees one 64 MB tensor settles after a
few rounds at 512 MB more RSS than with mmap; the Marian run peaked at the same RSS either way,
2,774 and 2,755 MB). `ENCDEC_KEEP_FREED_MEMORY=0` leaves malloc as it is. Other C libraries
(macOS, musl) and a preloaded allocator are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed memory for reuse (see module doc). Returns whether it now does."""
    if os.environ.get("ENCDEC_KEEP_FREED_MEMORY", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        done = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    except (OSError, AttributeError):  # no mallopt in this process's C library
        return False
    if done:
        logger.debug("malloc keeps freed memory for reuse (ENCDEC_KEEP_FREED_MEMORY=0 to hand it back)")
    return done
