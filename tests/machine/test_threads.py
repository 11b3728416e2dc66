"""torch's CPU threads: `threads=N` (CLI and server `--threads`), by default $OMP_NUM_THREADS or the cores the
process may use (its affinity mask, not the machine's count); and the server's start-up log."""

import json
import logging
import os
import subprocess
import sys

import pytest
from helpers import make_whisper

from encdec_engine.config import EngineConfig

PROBE = """
import json, os, torch
from encdec_engine.machine.threads import configure_threads
cores = sorted(os.sched_getaffinity(0))
out = {"cores": len(cores), "default": configure_threads(None), "torch": torch.get_num_threads(),
       "interop": torch.get_num_interop_threads()}
os.sched_setaffinity(0, cores[:1])  # as taskset -c would
out["one_core"], out["torch_one_core"] = configure_threads(None), torch.get_num_threads()
out["asked"], out["torch_asked"] = configure_threads(3), torch.get_num_threads()
print(json.dumps(out))
"""


def probe(**env_overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(ENCDEC_DEV_THREADS="0", **env_overrides)  # ENCDEC_DEV_THREADS: the shared dev venv's 1-thread cap off
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.integration  # a subprocess of the engine
def test_threads_default_to_the_cores_this_process_may_use():
    out = probe()
    assert out["default"] == out["torch"] == out["interop"] == out["cores"]
    assert out["one_core"] == out["torch_one_core"] == 1  # the affinity mask counts, not the machine
    assert out["asked"] == out["torch_asked"] == 3


@pytest.mark.integration  # a subprocess of the engine
def test_omp_num_threads_is_honoured_when_threads_is_not_given():
    out = probe(OMP_NUM_THREADS="1")
    assert out["default"] == out["torch"] == out["one_core"] == 1 and out["asked"] == 3


def test_threads_must_be_positive():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            EngineConfig(model="x", threads=bad)


def test_server_logs_model_device_dtype_threads_and_kv_pool(tmp_path, monkeypatch, caplog):
    import uvicorn

    from encdec_engine.server.app import run_server

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *args, **kwargs: None)  # start up, serve nothing
    path = make_whisper(tmp_path / "whisper", "tiny-80")
    engine_logger = logging.getLogger("encdec_engine")
    try:
        with caplog.at_level(logging.INFO, logger="encdec_engine"):
            run_server(str(path), kv_cache_space_gb=0.05, threads=1, log_level="info")
    finally:
        engine_logger.handlers.clear()
        engine_logger.setLevel(logging.NOTSET)
    assert f"serving 'whisper': model {path} (WhisperForConditionalGeneration) on cpu, float32, 1 CPU threads, " \
           "KV pool of" in caplog.text
    assert "CPU threads: 1 (asked for)" in caplog.text and "KV pool:" in caplog.text
