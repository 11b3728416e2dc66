"""torch's CPU thread pools, set once per process before the model loads (openai-whisper's --threads,
faster-whisper's cpu_threads).

torch's intra-op default follows OpenMP's, its inter-op pool counts every core of the machine even
under taskset. Neither knows what else runs: on a CPU shared with other work, fewer threads than
cores can be several times faster, since every matmul waits for its slowest thread. Hence a knob.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask), where the OS tells."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity masks
        return os.cpu_count() or 1


def default_threads() -> tuple[int, str]:
    """(threads, where the number comes from): $OMP_NUM_THREADS when it is a positive integer, as torch
    itself honours it; else the cores this process may use."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), "$OMP_NUM_THREADS"
    return usable_cores(), "the cores this process may use"


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to `threads` (None: `default_threads()`) and, while torch still
    allows it, its inter-op pool to the same bound. Returns the intra-op count."""
    source = "asked for"
    if threads is None:
        threads, source = default_threads()
    torch.set_num_threads(threads)
    # The engine runs no inter-op parallel work itself; the bound keeps the pool (one thread per
    # physical core by default) within `threads`. torch fixes it once anything has used it.
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        logger.debug("torch's inter-op pool is already fixed at %d threads", torch.get_num_interop_threads())
    logger.info("CPU threads: %d (%s); torch intra-op %d, inter-op %d", threads, source, torch.get_num_threads(),
                torch.get_num_interop_threads())
    return threads
