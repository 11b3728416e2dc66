"""Which kernel runs the CPU linears, chosen per machine; applied once after loading.

Machines of one kind differ: some have AVX-512, some only AVX2, and the fastest kernel is not
the same on both. torch reports what its own kernels use (`get_cpu_capability()`: "AVX2",
"AVX512", ...), and a short calibration (a few matmuls, a fraction of a second, once per machine)
times the candidates on three shapes a model runs: a decode row through an FFN layer, a
256-row batch through it, and a decode row through a 51,864-way vocab head. The timings are kept
per machine (`cpu_kernels.json` in the model cache, keyed by the CPU model, torch's capability and
version, the thread count and the probes), so later processes on the machine take the same
kernels without timing them again; `ENCDEC_RECALIBRATE=1` times them anew (and keeps the new ones).

    fp32   "mkl" (`F.linear`) or "onednn" (`PackedLinear`: the weight packed once). AVX-512
           machines start from onednn (about 2x MKL there, which keeps AMD CPUs on AVX2),
           the others from mkl (the two about even on an AVX2 EPYC); the other one is taken
           only when the calibration finds it `MARGIN` faster over the probes.
    int8   fbgemm's dynamic int8 x int8 for every row count; on AVX-512 the weight-only
           `_weight_int8pack_mm` for decode rows if the calibration finds it faster there
           (below AVX-512 torch has no vectorized kernel for it: 10-100x slower than fbgemm).
           The linears a model names as having outliers in their inputs (Whisper's encoder fc2)
           take int8 with a scale per activation row ("rows", `RowScaledInt8Weight`) where
           `torch._int_mm` sums exactly (checked once: without VNNI oneDNN may saturate) and
           the calibration does not find the fp32 kernel `MARGIN` faster on a 256-row batch
           through such a layer; fp32 otherwise (`ENCDEC_INT8_OUTLIERS=rows|fp32` pins one).

    bf16   a bf16 model's linears always on oneDNN's packed bf16 where the CPU multiplies bf16
           natively (AVX-512 BF16, AMX); `fastest_dtype` (dtype="fastest", compute_type="auto") times
           them against the fp32 kernel on the same probes and takes bf16 only `MARGIN` faster.

The choice is logged once per process. `choose_fp32` and `choose_int8_decode` are pure, so a
test can give them any capability and timings.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from encdec_engine.cache import cache_root
from encdec_engine.quantization.int8_weights import (Int8Weight, RowScaledInt8Weight, fbgemm_available, int_mm_is_exact,
                                                     is_float_cpu, quantize_linears)
from encdec_engine.layers.linear import PackedWeight, bf16_native, onednn_packing_available, pack_linears, packs

logger = logging.getLogger(__name__)

CALIBRATION_FILE = "cpu_kernels.json"  # in the model cache: {machine key: {"kernel/probe": seconds}}
MARGIN = 0.10  # an alternative must beat the capability's default by this much over the probes
# (name, rows, in_features, out_features, repetitions): shapes a model runs, each probe ~10-50 ms.
PROBES = (("decode", 1, 768, 3072, 20), ("batch", 256, 768, 3072, 3), ("vocab", 1, 384, 51864, 3))
_INT8_DECODE_PROBES = ("decode", "vocab")
OUTLIER_PROBES = (("ffn_out", 256, 3072, 768, 3),)  # a batch through an FFN's second linear


def is_avx512(capability: str) -> bool:
    return capability.upper().startswith("AVX512")


def _score(timings: dict[str, float], kernel: str, rivals: list[str], probes: list[str]) -> float:
    """Geometric mean over the probes of this kernel's time relative to the fastest rival's."""
    ratios = [timings[f"{kernel}/{p}"] / min(timings[f"{k}/{p}"] for k in rivals) for p in probes]
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def _pick(default: str, other: str, timings: dict[str, float], probes: list[str]) -> str:
    if not all(f"{k}/{p}" in timings for k in (default, other) for p in probes):
        return default
    rivals = [default, other]
    return other if _score(timings, other, rivals, probes) < (1 - MARGIN) * _score(timings, default, rivals, probes) \
        else default


def choose_fp32(capability: str, onednn: bool, timings: dict[str, float]) -> str:
    """"mkl" or "onednn" for fp32 linears; `timings` maps "kernel/probe" to seconds."""
    if not onednn:
        return "mkl"
    default, other = ("onednn", "mkl") if is_avx512(capability) else ("mkl", "onednn")
    return _pick(default, other, timings, [p[0] for p in PROBES])


def choose_dtype(bf16_native: bool, timings: dict[str, float]) -> str:
    """"bfloat16" or "float32" for dtype="fastest": bf16 only where the CPU multiplies it natively and the
    calibration finds it `MARGIN` faster than this machine's fp32 kernel over the probes."""
    if not bf16_native:
        return "float32"
    return "bfloat16" if _pick("fp32", "bf16", timings, [p[0] for p in PROBES]) == "bf16" else "float32"


def choose_int8_decode(capability: str, timings: dict[str, float]) -> str:
    """"fbgemm" or "int8pack" for int8 decode rows (batches always run fbgemm)."""
    if not is_avx512(capability):
        return "fbgemm"
    return _pick("fbgemm", "int8pack", timings, list(_INT8_DECODE_PROBES))


def choose_int8_outliers(exact: bool, timings: dict[str, float]) -> str:
    """"rows" or "fp32" for the linears whose inputs have outliers (`exact`: `torch._int_mm` sums exactly)."""
    if not exact:
        return "fp32"
    return _pick("rows", "fp32", timings, [p[0] for p in OUTLIER_PROBES])


def _time(fn: Callable[[], torch.Tensor], reps: int) -> float:
    """The fastest of `reps` calls: other processes on the cores only ever add time."""
    fn()  # first call: allocation, kernel selection
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(kernels: dict[str, Callable[[torch.Tensor, torch.Tensor], Callable]],
              probes: tuple = PROBES) -> dict[str, float]:
    """Seconds of each kernel on each probe (its fastest call): {"kernel/probe": s}. A kernel is
    `prepare(weight, bias) -> fn(x)`; candidates alternate per probe, so a busy moment
    of the machine hurts them alike."""
    timings: dict[str, float] = {}
    generator = torch.Generator().manual_seed(0)
    for name, rows, k, n, reps in probes:
        weight = torch.randn(n, k, generator=generator) * k**-0.5
        x = torch.randn(rows, k, generator=generator)
        ready = {kernel: prepare(weight, None) for kernel, prepare in kernels.items()}
        for kernel, fn in ready.items():
            timings[f"{kernel}/{name}"] = _time(partial(fn, x), reps)
    return timings


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's on Linux), for telling machines apart."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(kernels: list[str], probes: tuple) -> str:
    """What a calibration's timings hold for: this CPU, torch build and thread count, these kernels and probes."""
    return json.dumps({"cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(),
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "kernels": sorted(kernels), "probes": [list(p) for p in probes]}, sort_keys=True)


def _read_calibrations(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # unreadable or half written: time the kernels again
        logger.warning("%s: unreadable (%s); calibrating the CPU kernels again", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def calibrate_once(kernels: dict[str, Callable], probes: tuple = PROBES,
                   path: Path | None = None) -> tuple[dict[str, float], Path | None]:
    """`calibrate`, kept per machine in `path` (default: the model cache's CALIBRATION_FILE): the
    timings of an earlier process with the same key when there are any (and ENCDEC_RECALIBRATE is
    not set), else new ones, stored. Returns (timings, the file they came from, or None if measured
    now). A file that cannot be written only costs the next process another calibration."""
    path = path or cache_root() / CALIBRATION_FILE
    key = calibration_key(list(kernels), probes)
    known = _read_calibrations(path)
    cached = known.get(key)
    if not os.environ.get("ENCDEC_RECALIBRATE") and isinstance(cached, dict) and \
            set(cached) == {f"{k}/{p[0]}" for k in kernels for p in probes} and \
            all(isinstance(s, (int, float)) for s in cached.values()):
        return {name: float(s) for name, s in cached.items()}, path
    timings = calibrate(kernels, probes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        known = _read_calibrations(path)  # another process may have added its machine meanwhile
        known[key] = timings
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
            json.dump(known, f, indent=1)
        os.replace(f.name, path)
    except OSError as e:
        logger.warning("could not keep the CPU kernel calibration in %s (%s)", path, e)
    return timings, None


def _plain(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return partial(F.linear, weight=weight, bias=bias)


def _int8(decode_kernel: str) -> Callable:
    return partial(Int8Weight.quantize, decode_kernel=decode_kernel, decode_rows=1 << 30)


@dataclass(frozen=True)
class CpuLinearPlan:
    capability: str  # torch's CPU capability, e.g. "AVX2", "AVX512"
    fp32: str  # "mkl" or "onednn"
    int8_decode: str | None = None  # "fbgemm" or "int8pack"; None: no int8 weights
    timings: dict[str, float] = field(default_factory=dict, compare=False)  # calibration, seconds
    calibration_file: Path | None = field(default=None, compare=False)  # where the timings were kept, if not timed now
    int8_outliers: str | None = None  # "rows" or "fp32": the linears with outliers in their inputs
    bf16: bool = False  # a bf16 model: its linears on oneDNN's native bf16 (packed weights)

    def describe(self) -> str:
        if self.bf16:
            what = "bf16 linears through oneDNN (packed weights, native bf16)"
        elif self.int8_decode is None:
            what = "fp32 linears through " + ("oneDNN (packed weights)" if self.fp32 == "onednn" else "MKL (F.linear)")
        else:
            decode = "weight-only _weight_int8pack_mm" if self.int8_decode == "int8pack" else "fbgemm"
            what = f"int8 linears (per-channel scales) through fbgemm dynamic int8, decode rows through {decode}"
            what += (", linears with input outliers int8 with a scale per row (torch._int_mm)"
                     if self.int8_outliers == "rows" else ", linears with input outliers in fp32")
        probes = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.timings.items())
        source = f" in an earlier process, kept in {self.calibration_file}" if self.calibration_file else ""
        return f"CPU {self.capability}: {what}" + (f" (calibrated{source}: {probes})" if probes else "")


@functools.cache
def machine_plan(int8: bool) -> CpuLinearPlan:
    """This machine's kernels (calibrated once per machine, see `calibrate_once`; logged once per process)."""
    capability = torch.backends.cpu.get_cpu_capability()
    onednn = onednn_packing_available()
    if int8:
        if not fbgemm_available():
            raise ValueError("quantization='int8' needs torch's fbgemm int8 kernels, which this torch build "
                             f"lacks (quantized engines: {torch.backends.quantized.supported_engines})")
        timings, source = calibrate_once({"fbgemm": _int8("fbgemm"), "int8pack": _int8("int8pack")},
                                         tuple(p for p in PROBES if p[0] in _INT8_DECODE_PROBES)) \
            if is_avx512(capability) else ({}, None)
        exact = int_mm_is_exact()
        pinned = os.environ.get("ENCDEC_INT8_OUTLIERS", "").lower()  # the same kernel in every process
        if pinned not in ("", "rows", "fp32"):
            raise ValueError(f"ENCDEC_INT8_OUTLIERS={pinned!r}: use rows or fp32")
        if pinned == "rows" and not exact:
            raise ValueError("ENCDEC_INT8_OUTLIERS=rows: torch._int_mm does not sum int8 products exactly here")
        if exact and not pinned:
            fp32 = PackedWeight if machine_plan(int8=False).fp32 == "onednn" else _plain
            outlier_timings, outlier_source = calibrate_once({"rows": RowScaledInt8Weight.quantize, "fp32": fp32},
                                                             OUTLIER_PROBES)
            timings, source = {**timings, **outlier_timings}, source or outlier_source
        plan = CpuLinearPlan(capability, "mkl", choose_int8_decode(capability, timings), timings, source,
                             int8_outliers=pinned or choose_int8_outliers(exact, timings))
    else:
        pinned = os.environ.get("ENCDEC_CPU_LINEAR", "").lower()  # the same kernel in every process
        if pinned not in ("", "default", "mkl", "onednn"):
            raise ValueError(f"ENCDEC_CPU_LINEAR={pinned!r}: use default, mkl or onednn")
        timings, source = calibrate_once({"mkl": _plain, "onednn": PackedWeight}) if onednn and not pinned \
            else ({}, None)
        if not pinned:
            kernel = choose_fp32(capability, onednn, timings)
        elif pinned == "default":  # the capability's default, uncalibrated
            kernel = "onednn" if onednn and is_avx512(capability) else "mkl"
        else:
            kernel = pinned
        if kernel == "onednn" and not onednn:
            raise ValueError("ENCDEC_CPU_LINEAR=onednn: this torch build cannot pack weights for oneDNN")
        plan = CpuLinearPlan(capability, kernel, None, timings, source)
    logger.info("%s", plan.describe())
    return plan


def _bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A bf16 model's linear as calibrated: the weight packed in bf16, the probe's input rounded to bf16."""
    packed = PackedWeight(weight.bfloat16(), None if bias is None else bias.bfloat16())
    return lambda x: packed(x.bfloat16())


@functools.cache
def fastest_dtype() -> str:
    """The floating type the CPU runs fastest here, for dtype="fastest" ("bfloat16" or "float32"; see
    `choose_dtype`); calibrated once per machine, logged once per process."""
    native = bf16_native()
    timings: dict[str, float] = {}
    if native:
        fp32 = PackedWeight if machine_plan(int8=False).fp32 == "onednn" else _plain
        timings, _ = calibrate_once({"fp32": fp32, "bf16": _bf16})
    dtype = choose_dtype(native, timings)
    probes = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timings.items())
    logger.info("dtype='fastest': %s (%s)", dtype, f"calibrated: {probes}" if native
                else "no native bf16 on this CPU: bf16 would be emulated")
    return dtype


def prepare_cpu_linears(model: nn.Module, quantization: str | None,
                        bf16_parts: Sequence[nn.Module] = ()) -> CpuLinearPlan | None:
    """Put the loaded model's CPU linears (and its vocab head) on this machine's kernels.

    Returns the plan, or None when nothing runs on the CPU in a kernel chosen here (CUDA,
    half precision). Called once, after the weights are loaded and moved. `bf16_parts` (int8 only):
    submodules already in bf16 (compute type int8_bfloat16's encoder and cross K/V projections) whose
    linears stay bf16, packed where the CPU multiplies bf16 natively.
    """
    projection = getattr(model, "vocab_projection", None)
    if quantization == "int8":
        plan = machine_plan(int8=True)
        bf16_linears = [m for part in bf16_parts for m in part.modules() if isinstance(m, nn.Linear)]
        # The linears whose inputs have outliers (that one 8-bit scale over a block of rows loses): int8
        # with a scale per row, or this machine's fp32 kernel.
        outliers = [m for m in getattr(model, "linears_with_outlier_inputs", list)()
                    if not any(m is b for b in bf16_linears)]
        if plan.int8_outliers == "rows":
            quantize_linears(model, plan.int8_decode, keep=bf16_linears, per_row=outliers)
        else:
            quantize_linears(model, plan.int8_decode, keep=outliers + bf16_linears)
            if outliers and machine_plan(int8=False).fp32 == "onednn":
                pack_linears(model)
        if bf16_parts:
            pack_linears(model, torch.bfloat16)
        if projection is not None:
            projection.use(partial(Int8Weight.quantize, decode_kernel=plan.int8_decode), is_float_cpu)
        return plan
    if not any(packs(p) for p in model.parameters()):  # CUDA, fp16, emulated bf16: F.linear as it is
        return None
    if any(p.dtype == torch.bfloat16 for p in model.parameters()):
        # Native bf16 is always packed: 1.3-2.6x F.linear's bf16 from 1 to 1,500 rows (Xeon with AMX, 2 threads;
        # a one-off measurement).
        pack_linears(model)
        if projection is not None:
            projection.use(PackedWeight)
        plan = CpuLinearPlan(torch.backends.cpu.get_cpu_capability(), "onednn", bf16=True)
        logger.info("%s", plan.describe())
        return plan
    plan = machine_plan(int8=False)
    if plan.fp32 == "onednn":
        pack_linears(model)
        if projection is not None:
            projection.use(PackedWeight)
    return plan

