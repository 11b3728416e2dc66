"""torch's CPU thread pools: set once per process before the model loads (openai-whisper's --threads,
faster-whisper's cpu_threads), and by default fitted while the engine runs to the cores other
processes leave free (`CoreShare`).

torch's intra-op default follows OpenMP's, its inter-op pool counts every core of the machine even
under taskset. Neither knows what else runs. On cores shared with another process, a thread of
every parallel region (each matmul, each attention read) waits for its sibling that the other
process holds off the core, and libgomp's waiting threads spin before they sleep, burning the core
the other process needed: two `encdec transcribe` jobs at once on a 2-core Xeon took 7x their time
alone, each spending 25 s of CPU on a job that needs 5 s alone. With a thread fewer than the cores
other work leaves, nothing waits on a sibling and nothing spins.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence

import torch

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask), where the OS tells."""
    cores = _affinity()
    return len(cores) if cores is not None else os.cpu_count() or 1


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


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch ops of the calling thread run on one thread meanwhile (the count is the calling thread's own
    under OpenMP; other threads keep theirs). For small ops beside the engine's steps (the live sessions'
    voice detection on the event loop): split over two threads while the engine's own two run, they
    waited on each other and spun (Silero's 0.24 ms frame took 0.51 ms beside a 2-thread matmul loop,
    0.24 ms on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def own_threads(threads: int) -> None:
    """The calling thread's torch ops run on `threads` threads from now on, whatever other threads set
    later. torch gives a thread the process-wide count (the last any thread set) at its first parallel op
    or count query, over whatever the thread set before, so the query comes first. Without it the server's
    input workers, set to one thread before the engine thread set its 2, ran their log-mels on 2: a second
    OpenMP team beside the engine's, and libgomp, with more threads in teams than cores, stopped letting the
    engine's worker spin between parallel regions (its decode steps took twice their time)."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def single_threaded() -> None:
    """A worker thread's initializer: its torch ops run on one thread (see `one_thread`, `own_threads`)."""
    own_threads(1)


def beside_engine_thread() -> None:
    """For a thread that runs beside an engine thread (the server's event loop): its torch ops on one
    thread, and its OpenMP worker threads released. libgomp spins a team's idle workers only while the
    process holds no more threads in teams than it has cores; a second team (the thread that loaded the
    model kept its own) made every worker sleep between parallel regions and wake for the next: the same
    steps run on the engine thread took 1.4x their time on the loading thread, at 1.4 cores of 2 (a
    64x384x1536 matmul: 384 us against 284 us, 1.6 cores against 2.0; a fresh thread that never ran a
    parallel region costs nothing)."""
    single_threaded()
    release_openmp_pool()


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (OpenMP 5's omp_pause_resource_all, soft), in the
    runtime torch uses; a later parallel region of this thread makes them anew. False where the runtime
    has no such call."""
    for path in _openmp_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause(1) == 0  # omp_pause_soft
    return False


def _openmp_runtimes() -> list[str]:
    """The OpenMP runtimes loaded in this process (libgomp with torch's Linux wheels), from its memory map."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "omp" in line and ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp")))


_overridden: set[int] = set()  # the counts found set by others, each warned about once


def keep_threads(threads: int) -> None:
    """Put torch's intra-op threads back to the engine's `threads` if something else in the process changed
    them: the count is process-wide, and a library that sets it (importing silero_vad sets 1) slowed the
    engine and changed its int8 outputs (a different split of its work). Called before each step: a
    getter call when nothing changed."""
    found = torch.get_num_threads()
    if found == threads:
        return
    if found not in _overridden:
        _overridden.add(found)
        logger.warning("torch's CPU threads were set to %d by something else in this process (importing "
                       "silero_vad sets 1); the engine keeps its %d", found, threads)
    torch.set_num_threads(threads)


def fits_threads(threads: int | None) -> bool:
    """Whether the engine fits its thread count to the free cores (`CoreShare`): for the default count only,
    unless $ENCDEC_FIT_THREADS=0."""
    return (threads is None and default_threads()[1] != "$OMP_NUM_THREADS"
            and os.environ.get("ENCDEC_FIT_THREADS", "1") != "0")


class CoreShare:
    """Keeps torch's intra-op threads within the cores that other processes leave free: every `window`
    seconds of engine steps (`update`, called before each step) it compares the busy time of this
    process's cores (/proc/stat) with this process's own CPU time; what the others used, in cores,
    comes off the `threads` the engine was given (at least 1 stays), and goes back when they stop.

    Linux only (`CoreShare.here()` is None elsewhere). Only the default thread count is fitted: a count
    asked for (`threads=N`, $OMP_NUM_THREADS) is the user's to keep."""

    window = 0.25  # seconds between measurements (/proc/stat counts in 10 ms ticks)
    threshold = 0.4  # cores the others must use for a thread to make way (a little background is noise)
    first_window = 0.1  # seconds: the first look, before the load (idle: nothing of this process runs)

    def __init__(self, threads: int, busy: Callable[[], float], own: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic, set_threads: Callable[[int], None] = torch.set_num_threads,
                 ) -> None:
        self.threads, self.current = threads, threads
        self._busy, self._own, self._clock, self._set = busy, own, clock, set_threads
        self._last = (clock(), busy(), own())
        self.others = 0.0  # cores the other processes used in the last window

    @classmethod
    def here(cls, threads: int) -> CoreShare | None:
        """The share of this process's cores, measured once before the model loads where another process
        is running now (loading packs weights and runs a forward: contended, it took 4 s instead of 0.3)."""
        cores = _affinity()
        if cores is None or not os.path.exists("/proc/stat") or threads < 2:
            return None
        share = cls(threads, lambda: _busy_seconds(cores))
        if _others_running():
            time.sleep(cls.first_window)
            share.update(force=True)
        return share

    def update(self, force: bool = False) -> int:
        """The thread count for the next step (changed in torch when it changes)."""
        now = self._clock()
        start, busy0, own0 = self._last
        if now - start < (0 if force else self.window):
            return self.current
        busy, own = self._busy(), self._own()
        self._last = (now, busy, own)
        self.others = max(0.0, (busy - busy0) - (own - own0)) / (now - start)
        want = self.threads if self.others < self.threshold else max(1, self.threads - math.ceil(self.others - 0.25))
        if want != self.current:
            logger.info("CPU threads %d -> %d: other processes use %.1f of this process's cores",
                        self.current, want, self.others)
            self._set(want)
            self.current = want
        return self.current


def _others_running(looks: int = 5, apart: float = 0.001) -> bool:
    """Whether another thread keeps running somewhere on the machine: /proc/loadavg counts more than this
    one running or ready to run at most of a few instants (a busy process shows at nearly all of them; a
    kernel thread waking, at about one read in a hundred)."""
    seen = 0
    for _ in range(looks):
        try:
            with open("/proc/loadavg") as f:
                seen += int(f.read().split()[3].partition("/")[0]) > 1
        except (OSError, ValueError, IndexError):
            return False
        time.sleep(apart)
    return seen > looks // 2


def _affinity() -> list[int] | None:
    """The cores this process may run on, or None where the OS has no affinity masks (macOS, Windows)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None


_TICK = 1 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def _busy_seconds(cores: Sequence[int]) -> float:
    """Seconds the given cores have spent busy since boot, whoever ran (user, nice, system, irq, softirq,
    steal: a hypervisor's steal is a core this process did not get)."""
    wanted, busy = {f"cpu{c}" for c in cores}, 0
    with open("/proc/stat") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name in wanted:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, rest.split()[:8])
                busy += user + nice + system + irq + softirq + steal
    return busy * _TICK
