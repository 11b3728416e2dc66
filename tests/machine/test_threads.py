"""torch's CPU threads: `threads=N` (CLI and server `--threads`), by default $OMP_NUM_THREADS or the cores the
process may use (its affinity mask, not the machine's count); and the server's start-up log."""

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
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


class Machine:
    """A fake of what CoreShare reads: the clock, the busy seconds of this process's cores, its own CPU time."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0
        self.set_to: list[int] = []

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)

    def share(self, threads: int = 2):
        from encdec_engine.machine.threads import CoreShare

        return CoreShare(threads, busy=lambda: self.busy, own=lambda: self.own, clock=lambda: self.now,
                         set_threads=self.set_to.append)


def test_the_thread_count_makes_way_for_other_processes_and_comes_back():
    """Two jobs at once on 2 cores each took 7x their time alone (every parallel region's thread waited,
    spinning, for its sibling the other job held off the core); fitted, each keeps one core."""
    machine = Machine()
    share = machine.share(threads=2)
    machine.run(0.1, own_cores=2.0, other_cores=0.0)
    assert share.update() == 2 and machine.set_to == []  # within the window: not measured yet
    machine.run(0.3, own_cores=2.0, other_cores=0.05)  # background noise stays
    assert share.update() == 2 and machine.set_to == []
    machine.run(0.5, own_cores=1.0, other_cores=1.0)  # another job takes a core
    assert share.update() == 1 and machine.set_to == [1]
    machine.run(0.5, own_cores=1.0, other_cores=1.0)  # it keeps it: no change, no call
    assert share.update() == 1 and machine.set_to == [1]
    machine.run(0.5, own_cores=1.0, other_cores=0.0)  # it is gone
    assert share.update() == 2 and machine.set_to == [1, 2]


def test_at_least_one_thread_stays_and_what_others_use_is_rounded_to_cores():
    machine = Machine()
    share = machine.share(threads=4)
    machine.run(0.5, own_cores=1.0, other_cores=3.0)
    assert share.update() == 1
    machine.run(0.5, own_cores=2.0, other_cores=1.7)
    assert share.update() == 2 and share.others == pytest.approx(1.7)
    machine.run(0.5, own_cores=1.0, other_cores=9.0)  # more than the cores there are: still one
    assert share.update() == 1


def test_only_the_default_count_is_fitted(monkeypatch):
    from encdec_engine.machine.threads import fits_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("ENCDEC_FIT_THREADS", raising=False)
    assert fits_threads(None) and not fits_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not fits_threads(None)  # a count the user asked for, through the environment
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("ENCDEC_FIT_THREADS", "0")
    assert not fits_threads(None)


def test_the_busy_time_of_this_process_cores_is_read_from_proc_stat():
    from encdec_engine.machine.threads import CoreShare, _busy_seconds

    if not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"):
        pytest.skip("no /proc/stat here")
    cores = sorted(os.sched_getaffinity(0))
    before = _busy_seconds(cores)
    end = time.process_time() + 0.3
    while time.process_time() < end:  # keep one core busy
        pass
    assert _busy_seconds(cores) - before >= 0.2
    share = CoreShare.here(2)
    assert share is None or share.threads == 2


def test_a_count_another_library_set_is_put_back_before_each_step(tmp_path, make_llm, caplog, monkeypatch):
    """Importing silero_vad sets torch's threads to 1 for the whole process: the engine then ran on one
    core and its int8 outputs changed (a different split of the work). Each step puts its own count back
    and says so once."""
    import torch

    from encdec_engine import SamplingParams
    from encdec_engine.machine import threads

    monkeypatch.setattr(threads, "_overridden", set())  # nothing warned about yet in this process
    llm = make_llm(make_whisper(tmp_path / "whisper"), threads=2, quantization="int8")
    samples = [0.01 * (i % 7) for i in range(16000)]
    audio = {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (samples, 16000)}},
             "decoder_prompt": {"prompt_token_ids": [50257, 50362]}}
    params = SamplingParams(temperature=0.0, max_tokens=5)
    before = llm.generate([audio], params, use_tqdm=False)[0].outputs[0].token_ids
    try:
        with caplog.at_level(logging.WARNING, logger="encdec_engine.machine.threads"):
            for _ in range(2):
                torch.set_num_threads(1)  # what `import silero_vad` does
                after = llm.generate([audio], params, use_tqdm=False)[0].outputs[0].token_ids
                assert torch.get_num_threads() == 2 and after == before
    finally:
        torch.set_num_threads(llm.engine.threads)
    assert [r.getMessage() for r in caplog.records] == [
        "torch's CPU threads were set to 1 by something else in this process (importing silero_vad sets 1); "
        "the engine keeps its 2"]


def _in_thread(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


def test_a_thread_beside_the_engine_runs_one_torch_thread_and_releases_its_openmp_workers():
    """The threads' counts are their own (OpenMP's per-thread setting): the engine thread keeps its count
    while the thread beside it runs on one, and that thread's idle team is freed (a second team made the
    engine thread's workers sleep between parallel regions: threads.beside_engine_thread)."""
    from encdec_engine.machine.threads import _openmp_runtimes, beside_engine_thread, release_openmp_pool

    assert any("libgomp" in p or "omp" in p for p in _openmp_runtimes())  # torch's Linux wheels bring libgomp

    def beside():
        torch.ones(256, 256) @ torch.ones(256, 256)  # a parallel region: this thread now holds a team
        beside_engine_thread()
        return torch.get_num_threads(), release_openmp_pool()

    before = torch.get_num_threads()
    assert _in_thread(beside) == (1, True)
    assert torch.get_num_threads() == before  # this thread's count is untouched


def test_a_single_threaded_worker_stays_on_one_thread_when_the_engine_sets_its_count_later():
    """torch gives a thread the process-wide count at its first parallel op; the engine thread sets its own
    count before each step, so a worker set to one thread before that must not take the engine's count at its
    first log-mel (the server's input workers did, and their second OpenMP team halved the speed of the
    engine's decode steps: threads.single_threaded)."""
    from encdec_engine.machine.threads import single_threaded

    before = torch.get_num_threads()
    initialized, engine_set = threading.Event(), threading.Event()
    box = []

    def worker():
        single_threaded()
        initialized.set()
        engine_set.wait(10)
        torch.ones(512, 512) @ torch.ones(512, 512)  # its first parallel op
        box.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    try:
        initialized.wait(10)
        torch.set_num_threads(2)  # as the engine thread does before a step
        engine_set.set()
        t.join(10)
    finally:
        torch.set_num_threads(before)
    assert box == [1]


def test_the_engine_thread_takes_its_own_count_whatever_the_event_loop_set(tmp_path, make_llm, caplog, monkeypatch):
    """The server's event loop sets one torch thread for itself before the engine thread starts; the engine
    thread then takes its own count at once, not the process-wide 1 (which it used to take at its first step,
    warning that "something else" had set it)."""
    import asyncio

    from encdec_engine import SamplingParams
    from encdec_engine.engine.async_engine import AsyncLLMEngine
    from encdec_engine.machine import threads

    monkeypatch.setattr(threads, "_overridden", set())
    llm = make_llm(make_whisper(tmp_path / "whisper"), threads=2)
    audio = {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": ([0.0] * 16000, 16000)}},
             "decoder_prompt": {"prompt_token_ids": [50257, 50362]}}
    seen = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (seen.append(torch.get_num_threads()), step())[1])

    async def serve():
        engine = AsyncLLMEngine(llm.engine)
        try:
            async for _ in engine.generate(audio, SamplingParams(temperature=0.0, max_tokens=3), "r"):
                pass
        finally:
            await engine.shutdown()

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the event loop's own count (threads.beside_engine_thread)
        with caplog.at_level(logging.WARNING, logger="encdec_engine.machine.threads"):
            asyncio.run(serve())
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {2}
    assert not caplog.records
