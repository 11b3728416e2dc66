"""Batch jobs and replicated serving on a local Ray cluster (2 CPUs: 2 workers x 1 thread), checked against
the single-process `LLM` on the same checkpoints: a random-init BART and the default tiny.en.

The default run has the BART job that loses a worker and the 2 replicas (about 1.5 minutes with the
cluster's start); the tiny.en job and --resume after a killed driver are `slow` (`pytest -m slow`)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from helpers import mixed_prompts

from encdec_engine import SamplingParams, distributed
from encdec_engine.distributed import jobs, workers
from encdec_engine.distributed.inputs import audio_inputs
from encdec_engine.distributed.results import read_rows
from encdec_engine.cli.main import main
from encdec_engine.server.limits import ServerLimits
from encdec_engine.speech.writers import write_transcription
from encdec_engine.checkpoints.ct2.importer import default_model_path

pytestmark = pytest.mark.integration  # a Ray cluster

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "prompts" / "audio"
CLIPS = ["fox.wav", "coffee.wav", "weather.wav", "stella.wav", "thanks_fast.wav"]
SMALL_KV = {"kv_cache_space_gb": 0.25}  # each worker's pool: the default 2 GiB per engine is a lot for 2 engines
BART_KV = {"num_kv_blocks": 400}


def prompt_file(path: Path, tokenizer, n: int) -> Path:
    """Every prompt format, one per line, and one prompt the engine rejects (an id outside the vocabulary)."""
    lines = [json.dumps(p) for p in mixed_prompts(tokenizer, n)]
    lines.insert(3, json.dumps({"prompt_token_ids": [len(tokenizer) + 5]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def reference(llm, path: Path, max_tokens: int, batch_size: int) -> list[dict]:
    """The single-process run of a prompt file in the workers' batches (consecutive lines; a random
    model's near-ties can resolve differently in another batch): each line's tokens, or its error."""
    from encdec_engine.inputs.prompt_files import load_prompt_file

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = [p for p, _ in load_prompt_file(path)]
    out: list[dict] = []
    for start in range(0, len(prompts), batch_size):
        batch, valid = prompts[start:start + batch_size], []
        for prompt in batch:
            try:
                llm.engine.process_request(prompt, params)
                out.append({})
                valid.append(prompt)
            except ValueError as e:
                out.append({"error": str(e), "token_ids": []})
        outs = iter(llm.generate(valid, params, use_tqdm=False))
        for i in range(start, len(out)):
            if not out[i]:
                c = next(outs).outputs[0]
                out[i] = {"text": c.text, "token_ids": list(c.token_ids), "error": None}
    return out


def approx_floats(value):
    """`value` with every float as pytest.approx(rel=1e-5): for == against a JSON document."""
    if isinstance(value, dict):
        return {k: approx_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [approx_floats(v) for v in value]
    return pytest.approx(value, rel=1e-5, abs=1e-7) if isinstance(value, float) else value


@pytest.mark.slow  # about a minute: the default run keeps the BART job with a killed worker and the replicas
def test_transcribe_job_writes_what_the_single_process_run_writes(ray_cluster, make_llm, tmp_path):
    """tiny.en over 2 workers writes the files `LLM.transcribe` + the writers make in this process (text,
    srt, vtt and tsv byte for byte; JSON equal, its log-probabilities to 1e-5); a corrupt file and a
    missing one are error rows, never a failed job."""
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really audio")
    paths = [str(AUDIO / c) for c in CLIPS] + [str(corrupt), str(tmp_path / "missing.wav")]
    out = tmp_path / "out"
    rows = distributed.transcribe(paths, output_dir=out, num_workers=2, batch_size=2, engine=SMALL_KV,
                                  progress=False, word_timestamps=True)
    assert [r["id"] for r in rows] == paths
    assert Counter(r["id"] for r in read_rows(out / "results.jsonl")) == Counter(paths)  # one row each
    assert len({r["worker"]["pid"] for r in rows}) == 2

    expected = make_llm(default_model_path(), **SMALL_KV).transcribe(paths, word_timestamps=True)
    reference_dir = tmp_path / "reference"
    for path, row, t in zip(paths, rows, expected):
        assert (row["text"], row["language"], row["error"]) == (t.text, t.language, t.error)
        if t.error is not None:
            assert not list(out.glob(f"{Path(path).stem}.*"))
            continue
        for written in write_transcription(t, "all", reference_dir, path):
            if written.suffix != ".json":  # text, timestamps and words: byte for byte
                assert (out / written.name).read_bytes() == written.read_bytes(), written.name
            else:  # the same tokens; log-probabilities differ in the last bits with what shares a batch and
                # with encoder reuse (the same happens within one process), so those compare to 1e-5
                assert json.loads((out / written.name).read_text()) == approx_floats(json.loads(written.read_text()))
    assert "corrupt.wav" in rows[-2]["error"] and "not found" in rows[-1]["error"]
    assert not list(out.glob(".*.tmp"))  # no temporary file is left behind


def test_generate_job_survives_a_killed_worker_and_matches_the_single_process_run(ray_cluster, bart_path,
                                                                                 make_llm, tmp_path):
    """A worker SIGKILLed once the first rows arrive: its batch runs again in a restarted worker (a new
    process), the job completes, every prompt has exactly one row, and each row is the token-for-token
    output of the single-process LLM on the same batches."""
    llm = make_llm(bart_path, **BART_KV)
    prompts = prompt_file(tmp_path / "prompts.jsonl", llm.get_tokenizer(), 23)
    results = tmp_path / "results.jsonl"
    killed, before, after = None, set(), set()
    rows = distributed.generate(prompts, str(bart_path), results=results, num_workers=2, batch_size=2,
                                engine=BART_KV, progress=False, stream=True, max_tokens=24, temperature=0.0)
    seen = []
    for row in rows:
        seen.append(row)
        (after if killed else before).add(row["worker"]["pid"])
        if killed is None:
            killed = row["worker"]["pid"]
            os.kill(killed, signal.SIGKILL)
    assert len(seen) == 24 and Counter(r["id"] for r in read_rows(results)) == Counter(str(i) for i in range(24))
    assert after - before, "no restarted worker took the killed worker's batches"
    expected = reference(llm, prompts, 24, batch_size=2)
    for row in sorted(seen, key=lambda r: int(r["id"])):
        ref = expected[int(row["id"])]
        assert row["error"] == ref["error"], row["id"]
        if ref["error"] is None:
            assert (row["text"], row["token_ids"]) == (ref["text"], ref["token_ids"]), row["id"]
        assert row["request_id"] == row["id"]
    assert "outside the vocabulary" in seen[[r["id"] for r in seen].index("3")]["error"]


@pytest.mark.slow  # 30-50 s: a CLI driver in a subprocess, then the resumed run
def test_resume_after_a_killed_driver_runs_only_the_rest(ray_cluster, bart_path, make_llm, tmp_path, monkeypatch):
    """`encdec generate --ray ADDRESS` in a subprocess is SIGKILLed once it has written some rows; a
    second run with --resume sends only the missing prompts to the cluster, and the results file ends
    with exactly one row per prompt, equal to the single-process run. Batches of one prompt: the resumed
    run batches what is left, and a random model's near-ties can resolve differently in another batch."""
    llm = make_llm(bart_path, **BART_KV)
    prompts = prompt_file(tmp_path / "prompts.jsonl", llm.get_tokenizer(), 15)
    results = tmp_path / "results.jsonl"
    argv = ["generate", str(prompts), "--model", str(bart_path), "--ray", ray_cluster, "--num-workers", "1",
            "--batch-size", "1", "--max-tokens", "24", "--kv-cache-space-gb", "0.05", "--results", str(results),
            "--quiet"]
    driver = subprocess.Popen([sys.executable, "-m", "encdec_engine.cli.main", *argv],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while (not results.exists() or len(read_rows(results)) < 2) and time.monotonic() < deadline:
        assert driver.poll() is None, driver.stderr.read()
        time.sleep(0.2)
    driver.kill()
    driver.wait()
    first = {r["id"] for r in read_rows(results)}
    assert 2 <= len(first) < 16, f"the driver was killed after {len(first)} of 16 rows"

    sent = []
    stream = jobs._stream

    def recording_stream(job, pending, *args):
        sent.extend(i.id for i in pending)
        return stream(job, pending, *args)

    monkeypatch.setattr(jobs, "_stream", recording_stream)
    assert main(argv + ["--resume"]) == 1  # prompt 3 fails (as in the first run), the others finish
    rows = read_rows(results)
    assert Counter(r["id"] for r in rows) == Counter(str(i) for i in range(16))
    assert set(sent) == {str(i) for i in range(16)} - (first - {"3"})  # the rest, and the error row again
    expected = reference(llm, prompts, 24, batch_size=1)
    differ = [r["id"] for r in rows if r["token_ids"] != expected[int(r["id"])]["token_ids"]]
    assert not differ, f"rows {differ} differ from the single-process run (first run: {sorted(first)})"


def completion(client: openai.OpenAI, i: int, extra: dict | None = None) -> str:
    kwargs = {"max_tokens": 16, **(extra or {})}
    return client.completions.create(model="bart", prompt=f"The city council met on day {i}.", temperature=0,
                                     **kwargs).choices[0].text


def test_two_replicas_serve_the_openai_client_and_survive_one_dying(ray_cluster, bart_path, make_llm):
    """Ray Serve with 2 BART replicas behind the OpenAI routes: the official client gets the
    single-process answers, whole and streamed, with the API key enforced; /metrics sums both replicas;
    the replica holding a long streamed request is SIGKILLed mid-stream: that stream fails (it does not
    end as if complete), the other long requests in flight end with 200 or a 5xx (none hangs), and the
    next requests succeed."""
    server = distributed.serve(str(bart_path), replicas=2, port=free_port(), served_model_name="bart", engine=BART_KV,
                               limits=ServerLimits(api_key="secret"), shutdown_timeout=5)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="secret", max_retries=0, timeout=120)
        llm = make_llm(bart_path, **BART_KV)
        for i in range(4):
            expected = llm.generate([f"The city council met on day {i}."],
                                    SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
            assert completion(client, i) == expected
        streamed = client.completions.create(model="bart", prompt="The city council met on day 0.", max_tokens=16,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == completion(client, 0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()

        metrics = metrics_text(server.url, want_replicas=2)
        pids = [int(p) for p in re.findall(r'encdec_replica_info\{replica="[^"]+",pid="(\d+)"', metrics)]
        per_replica = [int(v) for v in re.findall(r'encdec_kv_blocks_total\{replica="[^"]+",pool="device"\} (\d+)',
                                                   metrics)]
        summed = int(re.search(r'^encdec_kv_blocks_total\{pool="device"\} (\d+)$', metrics, re.M).group(1))
        assert len(pids) == 2 and len(per_replica) == 2 and summed == sum(per_replica) == 2 * 400

        # Long requests in flight on both replicas; a streamed one names its replica (x-encdec-replica, the
        # `replica` label of /metrics): SIGKILL that replica once the stream's first chunk arrives.
        pid_of = dict(re.findall(r'encdec_replica_info\{replica="([^"]+)",pid="(\d+)"', metrics))
        statuses: list = []
        threads = [threading.Thread(target=lambda i=i: statuses.append(status_of(client, i, LONG))) for i in range(4)]
        for t in threads:
            t.start()
        body = {"model": "bart", "prompt": "The harbour was quiet.", "stream": True, "temperature": 0,
                "max_tokens": LONG["max_tokens"], **LONG["extra_body"]}
        with post_stream(server.url, {**body, "max_tokens": 16, "min_tokens": 0}) as response:
            assert rest_of_stream(response.iter_lines()) == "done"  # how a stream that nothing stops ends
        with post_stream(server.url, body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(int(pid_of[response.headers["x-encdec-replica"]]), signal.SIGKILL)
            end = rest_of_stream(lines)
        # Its 200 went out with the first chunk: the stream breaks, or stops without a finish_reason and
        # without "data: [DONE]", never as a complete answer.
        assert end in ("broken", "stopped"), end
        for t in threads:
            t.join(timeout=180)
        print("statuses of the requests in flight when a replica died:", statuses)
        assert len(statuses) == 4 and all(s == 200 or s >= 500 for s in statuses), statuses
        for i in range(4):  # new requests go to the live replica (and Serve's replacement)
            assert completion(client, i)
    finally:
        server.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LONG = {"max_tokens": 240, "extra_body": {"min_tokens": 240}}  # about a second of decoding each


def post_stream(url: str, body: dict):
    return httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                        headers={"Authorization": "Bearer secret"})


def rest_of_stream(lines) -> str:
    """How an SSE stream of completions ends: "done" ([DONE] after a finish_reason), "stopped" (it ends
    without them) or "broken" (the connection fails)."""
    finished = done = False
    try:
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                finished |= json.loads(line[6:])["choices"][0]["finish_reason"] is not None
    except httpx.HTTPError as e:
        print("the stream of the killed replica broke:", repr(e))
        return "broken"
    return "done" if finished and done else "stopped"


def status_of(client: openai.OpenAI, i: int, extra: dict | None = None) -> int:
    try:
        completion(client, i, extra)
        return 200
    except openai.APIStatusError as e:
        print(f"a request in flight on the killed replica: {e.status_code} {e.response.text!r}")
        return e.status_code
    except openai.APIConnectionError:
        return 599  # the connection broke: a failure the client sees at once, as a 5xx


def metrics_text(url: str, want_replicas: int) -> str:
    """/metrics once every replica has reported (they report every second)."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer secret"}).text
        if text.count("encdec_replica_info{") >= want_replicas or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


class PoisonedTranscribeWorker(workers.TranscribeWorker):
    """Dies (as an OOM kill or a native crash would) whenever its batch holds poison.wav."""

    def run(self, ids, payloads):
        if any(Path(p["audio"]).name == "poison.wav" for p in payloads):
            os._exit(1)
        return super().run(ids, payloads)


def test_an_input_that_kills_its_worker_gets_an_error_row_and_the_rest_are_written(ray_cluster, make_llm,
                                                                                     tmp_path, caplog):
    """The issue's case: Ray Data's unlimited restarts and retries gave 34 worker deaths in 200 s and an empty
    results file. Now the dead worker's batch is split until the poisoned input stands alone; after
    MAX_ATTEMPTS deaths alone it gets one error row, and every other input of the job is written."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    poison = tmp_path / "poison.wav"
    poison.write_bytes((AUDIO / "fox.wav").read_bytes())
    paths = [str(AUDIO / c) for c in CLIPS[:3]] + [str(poison)] + [str(AUDIO / c) for c in CLIPS[3:]]
    out = tmp_path / "out"
    inputs = audio_inputs(paths)
    job = jobs.Job("transcribe", inputs, None, SMALL_KV, {"max_audio_seconds": 60.0}, batch_size=4,
                   worker=PoisonedTranscribeWorker)
    with caplog.at_level("WARNING", logger="encdec_engine.distributed.jobs"):
        rows = list(jobs.run(job, jobs.ClusterOptions(num_workers=2), jobs.Outputs(str(out / "results.jsonl"),
                                                                                  progress=False)))
    assert sorted(r["id"] for r in rows) == sorted(paths)
    bad = [r for r in rows if r["error"] is not None]
    assert [r["id"] for r in bad] == [str(poison)] and "died 2 times" in bad[0]["error"]
    deaths = [r for r in caplog.records if "worker died" in r.getMessage() or "took down" in r.getMessage()]
    assert len(deaths) == 4, [r.getMessage() for r in deaths]  # batches of 4, 2, 1, 1: log2(4) + MAX_ATTEMPTS
    expected = {t.source: t.text for t in make_llm(default_model_path(), **SMALL_KV).transcribe(paths[:3] + paths[4:])}
    assert {r["id"]: r["text"] for r in rows if r["error"] is None} == expected
    assert Counter(r["id"] for r in read_rows(out / "results.jsonl")) == Counter(paths)


def test_quiet_on_ray_prints_nothing_but_the_results(bart_path, tmp_path):
    """`--quiet --ray` used to print Ray's own warnings (token authentication, ...) and log lines; now a job
    that succeeds writes its results and nothing on stderr."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"The council met."\n"It rained."\n')
    results = tmp_path / "results.jsonl"
    done = subprocess.run([sys.executable, "-m", "encdec_engine.cli", "generate", str(prompts), "--model", str(bart_path),
                           "--ray", "--num-workers", "1", "--max-tokens", "4", "--kv-cache-space-gb", "0.05",
                           "--results", str(results), "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done.stderr
    assert len(read_rows(results)) == 2
