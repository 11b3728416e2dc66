"""Decode attention read straight from the paged KV pool (fp32 or bf16) on the CPU, through one C kernel.

A decode step has one query per sequence and head. torch has no kernel for that shape over a paged
pool: as batched matmuls each (sequence, head) is a product of one row, whose fixed cost outweighs
its bytes (BART-base, 256 sequences at 33 positions: 3,072 products of [1, 64] x [64, 33] read at
~14 GB/s), and the pool's layout [slot, head, dim] first needs head-major copies of the contexts.
`cpu_decode.c` walks each sequence's blocks in order instead, every head of a key row at once,
prefetching the rows ahead: the scores (q . k for every key and head), the softmax in torch, then the
probabilities times the values, each pass reading the pool once at near the memory's speed. A bf16
pool (a bf16 model's) is read as it is stored, each value widened to fp32 in the registers: half the
bytes, the same fp32 sums. A few sequences (Whisper at batch 1) split their keys into runs instead,
one task each.
`scripts/bench_decode_attention.py` times it against the copies' reads.

The kernel is compiled at first use for this machine (`cc -O3 -march=native -fopenmp`: AVX-512 on a
Zen 4/5, AVX2 on a Zen 3), linked to the OpenMP runtime torch loaded so that both share one thread
pool, checked once against torch on a small case, and kept under the model cache (`kernels/`, one
library per source, flags, compiler and CPU). Loading a library runs its code, so only one this user
could have built is loaded: the kernel folder must belong to this user (or root) and be writable by no
one else (this user's own loses group and other write bits), and so must the library (one that is not
is removed and built anew); both are checked on open file descriptors (no symlink followed) and the
library is loaded through its descriptor, so what was checked is what runs. Where it cannot be had
(no C compiler, torch without its own libgomp, a folder or library others could have written, a library
without the kernel's functions, a failed check) or `ENCDEC_FUSED_DECODE=0`, the log says why once and
the backend reads through its copies (`attention/backends/cpu_copies.py`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import math
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from encdec_engine.cache import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
TASKS_PER_THREAD = 4  # few sequences: split each one's keys into runs until the threads have this many tasks
MIN_RUN = 64  # keys: a shorter run costs more in its partial sums than it spreads
POOL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH  # mode bits that let others than the owner write

_P, _I = ctypes.c_void_p, ctypes.c_int64


class DecodeArgs(ctypes.Structure):
    """cpu_decode.c's `struct decode_args`, field for field (checked against the library's own layout
    when it loads): the operands of one call, by name."""

    _fields_ = [("query", _P), ("query_seq_stride", _I), ("query_head_stride", _I), ("keys", _P), ("values", _P),
                ("kv_bf16", _I), ("tables", _P), ("table_width", _I), ("lens", _P), ("num_seqs", _I), ("num_heads", _I),
                ("num_kv_heads", _I), ("head_dim", _I), ("width", _I), ("block_size", _I), ("max_len", _I),
                ("splits", _I), ("scores", _P), ("probs", _P), ("partial", _P), ("out", _P), ("threads", _I)]


class DecodeKernel:
    """The compiled kernel: `attend` reads one decode step's attention for a layer."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._scores, self._values = library.decode_scores, library.decode_values
        for function in (self._scores, self._values):
            function.argtypes, function.restype = [ctypes.POINTER(DecodeArgs)], None
        _check_layout(library)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
               max_len: int, mask: torch.Tensor | None = None,
               scratch: tuple[torch.Tensor, torch.Tensor] | None = None, indices_checked: bool = False) -> torch.Tensor:
        """softmax(query . keys + mask) @ values for each sequence's one query over its cached keys.

        query [S, H, D] fp32 (scaled; its last dim contiguous), kv_cache [2, blocks, block_size, Hkv, W]
        fp32 or bf16 (contiguous, W >= D), tables [S, >= ceil(max_len / block_size)] int64 block ids, lens [S]
        int64 keys per sequence (1..max_len), mask None or [S, H, max_len] added to the scores (a
        position bias; the kernel itself puts -inf past each sequence's length). `scratch`: two [S, H, max_len]
        fp32 tensors for the scores and probabilities, reused by a step's layers. `indices_checked`: the caller
        has passed these tables and lengths through `check_indices` for a pool of this many blocks (a step's
        layers share them: checked once, not at every layer). Returns [S, H, D]."""
        num_seqs, num_heads, head_dim = query.shape
        _, _, block_size, num_kv_heads, width = kv_cache.shape
        if (kv_cache.dtype not in POOL_DTYPES or query.dtype != torch.float32 or not kv_cache.is_contiguous()
                or query.stride(-1) != 1 or width < head_dim or num_heads % num_kv_heads
                or tables.dtype != torch.int64 or lens.dtype != torch.int64 or not tables.is_contiguous()
                or not lens.is_contiguous() or max_len > tables.shape[1] * block_size):
            raise ValueError(f"decode kernel: unsupported operands (query {tuple(query.shape)} {query.dtype}, "
                             f"cache {tuple(kv_cache.shape)} {kv_cache.dtype}, tables {tuple(tables.shape)})")
        if not indices_checked:
            check_indices(tables, lens, max_len, kv_cache.shape[1])
        threads = torch.get_num_threads()
        splits = max(1, min(math.ceil(TASKS_PER_THREAD * threads / max(num_seqs, 1)), max_len // MIN_RUN))
        shape = (num_seqs, num_heads, max_len)
        scores, probs = scratch or (torch.empty(shape), torch.empty(shape))
        out = torch.empty(num_seqs, num_heads, head_dim)
        partial = torch.empty(num_seqs, splits, num_heads, head_dim) if splits > 1 else out  # (unread at 1)
        args = DecodeArgs(query=query.data_ptr(), query_seq_stride=query.stride(0), query_head_stride=query.stride(1),
                          keys=kv_cache[0].data_ptr(), values=kv_cache[1].data_ptr(),
                          kv_bf16=int(kv_cache.dtype == torch.bfloat16), tables=tables.data_ptr(),
                          table_width=tables.shape[1], lens=lens.data_ptr(), num_seqs=num_seqs, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, head_dim=head_dim, width=width, block_size=block_size,
                          max_len=max_len, splits=splits, scores=scores.data_ptr(), probs=probs.data_ptr(),
                          partial=partial.data_ptr(), out=out.data_ptr(), threads=threads)
        self._scores(ctypes.byref(args))
        if mask is not None:
            scores += mask
        torch.softmax(scores, dim=-1, out=probs)
        self._values(ctypes.byref(args))
        return out


def check_indices(tables: torch.Tensor, lens: torch.Tensor, max_len: int, num_blocks: int) -> None:
    """Raises ValueError unless every length is within 1..max_len and every block id names one of the pool's
    `num_blocks` blocks: the C code trusts them, so nothing outside the pool is ever read."""
    if not lens.numel():
        return
    (low, high), (first, last) = torch.aminmax(lens), torch.aminmax(tables)
    low, high, first, last = int(low), int(high), int(first), int(last)
    if low < 1 or high > max_len or first < 0 or last >= num_blocks:
        raise ValueError(f"decode kernel: lengths {low}..{high} (of at most {max_len}) or block ids "
                         f"{first}..{last} outside the pool's {num_blocks} blocks")


def _check_layout(library: ctypes.CDLL) -> None:
    """Raises Unavailable unless the library's `struct decode_args` has DecodeArgs' size, and each field
    its offset and size."""
    want = [place for name, _ in DecodeArgs._fields_ for place in (getattr(DecodeArgs, name).offset,
                                                                    getattr(DecodeArgs, name).size)]
    layout = (ctypes.c_int64 * (2 + len(want) + 2))()  # room for one more field: a library with more shows it
    library.decode_args_layout.argtypes, library.decode_args_layout.restype = [ctypes.POINTER(ctypes.c_int64), _I], None
    library.decode_args_layout(layout, len(layout))
    size, count = layout[0], layout[1]
    places = list(layout[2 : 2 + min(2 * count, len(want) + 2)])
    if size != ctypes.sizeof(DecodeArgs) or places != want:
        raise Unavailable(f"its struct decode_args ({count} fields, {size} bytes, offsets and sizes {places}) is not "
                          f"DecodeArgs ({len(DecodeArgs._fields_)} fields, {ctypes.sizeof(DecodeArgs)} bytes, {want})")


def _openmp_runtime() -> Path | None:
    """The libgomp torch loaded (pip wheels carry their own in torch/lib); linking the kernel to it keeps
    one OpenMP thread pool in the process."""
    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if found:
        return found[0]
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = line.split()[-1]
            if "libgomp" in Path(path).name:
                return Path(path)
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _machine() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


class Unavailable(Exception):
    """Why the kernel cannot be had here (logged once; decode reads then use the copies)."""


class Untrusted(Unavailable):
    """A folder or library that someone other than this user (or root) could have written."""


def _library(compiler: str, openmp: Path, folder: Path, name: str) -> ctypes.CDLL:
    """The library `name` in the private `folder`, built first if it is not there. One there that is not
    this user's alone (it got there while the folder was open to others) is removed, never loaded, and
    built anew."""
    folder_fd = _open_private(folder)
    try:
        if _exists(folder_fd, name):
            try:
                return _open_library(folder_fd, folder, name)
            except Untrusted as e:
                logger.warning("%s; removing it and building the kernel anew", e)
                os.unlink(name, dir_fd=folder_fd)
        _build(compiler, openmp, folder, name)
        logger.info("built the fused CPU decode attention kernel: %s", folder / name)
        return _open_library(folder_fd, folder, name)
    finally:
        os.close(folder_fd)


def _build(compiler: str, openmp: Path, folder: Path, name: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, f"-L{openmp.parent}", f"-Wl,-rpath,{openmp.parent}",
                        f"-l:{openmp.name}"], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, folder / name)  # whole or not at all: another process may be building the same one
    except subprocess.CalledProcessError as e:
        raise Unavailable(f"{compiler} failed: {(e.stderr or '').strip()[-800:]}") from None
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"building {folder / name} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open_private(folder: Path) -> int:
    """A descriptor of `folder` (made 0700 if new), which must be this user's. One of this user's that others
    could write (an umask of 002 made it 0775) loses those bits: a library in it is checked on its own."""
    flags = os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        # O_PATH: another user's 0700 folder still opens, to be refused by its owner below
        fd = os.open(folder, os.O_PATH | flags)
    except OSError as e:  # a symlink in its place: ELOOP or ENOTDIR
        raise Unavailable(f"the kernel folder {folder} cannot be made or opened: {e}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid == os.geteuid() and info.st_mode & _OTHERS_WRITE:
            own = os.open(folder, os.O_RDONLY | flags)
            if os.path.samestat(os.fstat(own), info):
                os.fchmod(own, stat.S_IMODE(info.st_mode) & ~_OTHERS_WRITE)
                logger.info("%s could be written by other users (mode %04o): made it this user's alone", folder,
                            stat.S_IMODE(info.st_mode))
            os.close(own)
        _check_owner(fd, folder, "folder", " (give ENCDEC_CACHE a folder of your own)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_library(folder_fd: int, folder: Path, name: str) -> ctypes.CDLL:
    """dlopen `name` in the checked folder through a checked descriptor of its own: the file that was
    checked is the file that runs, whatever is renamed meanwhile. The descriptor stays open while the
    process lives (as the library stays loaded): dlopen knows a library by its name, and a later load
    through a reused descriptor number would be given this one."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder_fd)
    except OSError as e:
        kind = Untrusted if e.errno == errno.ELOOP else Unavailable  # a symlink put in its place
        raise kind(f"opening {folder / name} failed: {e}") from None
    try:
        _check_owner(fd, folder / name, "regular file", "")
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError as e:
        os.close(fd)
        raise Unavailable(f"loading {folder / name} failed: {e}") from None
    except BaseException:
        os.close(fd)
        raise


def _check_owner(fd: int, path: Path, kind: str, advice: str) -> None:
    """Refuses what someone other than this user (or root) could have written: loading a library runs it."""
    info, me = os.fstat(fd), os.geteuid()
    is_kind = stat.S_ISDIR(info.st_mode) if kind == "folder" else stat.S_ISREG(info.st_mode)
    if not is_kind:
        raise Unavailable(f"{path} is not a {kind}")
    if info.st_uid not in (me, 0):
        raise Untrusted(f"{path} belongs to uid {info.st_uid}, not to this user (uid {me}): not loading from it"
                        + advice)
    if info.st_mode & _OTHERS_WRITE:
        raise Untrusted(f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):04o}): not "
                        f"loading from it" + advice)


def _exists(folder_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _check(kernel: DecodeKernel) -> float:
    """Largest difference from torch on a small paged case (GQA, ragged lengths, blocks out of order),
    over an fp32 pool and over a bf16 one."""
    gen = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim, lens = 4, 4, 2, 24, [1, 7, 12]
    pool = torch.randn(2, 12, block_size, kv_heads, dim, generator=gen)
    tables = torch.tensor([[5, 0, 0], [3, 9, 0], [11, 1, 6]])
    query = torch.randn(len(lens), heads, dim, generator=gen)
    worst = 0.0
    for dtype in POOL_DTYPES:
        stored = pool.to(dtype)
        got = kernel.attend(query, stored, tables, torch.tensor(lens), max(lens))
        worst = max(worst, _difference(got, query, stored.float(), tables, lens))
    return worst


def _difference(got: torch.Tensor, query: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
                lens: list[int]) -> float:
    """Largest difference of `got` from softmax(q . k) @ v over each sequence's paged keys, in torch."""
    _, _, block_size, kv_heads, dim = cache.shape
    heads = query.shape[1]
    worst = 0.0
    for i, n in enumerate(lens):
        slots = tables[i, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        k = cache[0].reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        v = cache[1].reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        want = torch.softmax(query[i, :, None] @ k.transpose(1, 2), -1) @ v  # [H, 1, D]
        worst = max(worst, (got[i] - want[:, 0]).abs().max().item())
    return worst


@functools.cache
def load() -> DecodeKernel | None:
    """The kernel for this machine (built on first use), or None with the reason logged once."""
    if os.environ.get("ENCDEC_FUSED_DECODE", "1") == "0":
        logger.info("fused CPU decode attention off (ENCDEC_FUSED_DECODE=0): decode reads use head-major copies")
        return None
    if not sys.platform.startswith("linux"):
        return _unavailable(f"built on Linux only, not {sys.platform}")
    openmp, compiler = _openmp_runtime(), _compiler()
    if openmp is None:
        return _unavailable("torch's OpenMP runtime (libgomp) not found")
    if compiler is None:
        return _unavailable("no C compiler (set CC, or install gcc)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return _unavailable(f"{compiler} does not run: {e}")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, str(openmp), _machine()])
                         .encode()).hexdigest()[:16]
    folder, name = cache_root() / "kernels", f"cpu_decode-{key}.so"
    try:
        kernel = DecodeKernel(_library(compiler, openmp, folder, name), folder / name)
    except Unavailable as e:
        return _unavailable(str(e))
    except AttributeError as e:  # a library of that name without the kernel's functions
        return _unavailable(f"{folder / name} is not this kernel ({e})")
    worst = _check(kernel)
    if not worst < 1e-5:
        return _unavailable(f"{kernel.path} differs from torch by {worst:.3g} on the check case")
    return kernel


def _unavailable(reason: str) -> None:
    logger.warning("fused CPU decode attention unavailable (%s); decode reads use head-major copies", reason)
    return None
