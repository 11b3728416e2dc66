"""The parts of `encdec_engine.distributed` that need no cluster: inputs, the results file and resume, the
merged metrics, the CLI flags, the worker's model check, and the package working without Ray."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from encdec_engine.cli.ray import split_ray_address
from encdec_engine.distributed.inputs import audio_inputs, prompt_inputs, text_inputs
from encdec_engine.distributed.metrics_merge import merge
from encdec_engine.distributed.results import ResultsFile, read_rows
from encdec_engine.cli.main import build_parser, main
from encdec_engine.files import write_atomically

ROOT = Path(__file__).resolve().parents[2]


def touch(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_paths_folders_globs_and_manifests_become_inputs(tmp_path):
    a = touch(tmp_path / "a.wav")
    touch(tmp_path / "archive" / "2024" / "call.flac")
    touch(tmp_path / "archive" / "call.mp3")
    touch(tmp_path / "archive" / "notes.txt")  # not audio: a folder contributes audio only
    touch(tmp_path / "g" / "x1.wav")
    touch(tmp_path / "g" / "x2.wav")
    manifest = touch(tmp_path / "m.jsonl", "\n".join([json.dumps({"audio": "g/x1.wav", "id": "first", "output": "m/one"}),
                                                      "", json.dumps("a.wav") + " "]))
    items = audio_inputs([str(a), str(tmp_path / "archive"), str(tmp_path / "g" / "*.wav")], None)
    assert [(i.output, i.payload["audio"]) for i in items] == [
        ("a", str(a)), ("2024/call", str(tmp_path / "archive/2024/call.flac")),
        ("call", str(tmp_path / "archive/call.mp3")), ("x1", str(tmp_path / "g/x1.wav")),
        ("x2", str(tmp_path / "g/x2.wav"))]
    assert all(i.id == i.payload["audio"] for i in items)  # default id: the absolute path
    from_manifest = audio_inputs([], manifest)  # relative to the manifest's folder
    assert [(i.id, i.output, i.payload["audio"]) for i in from_manifest] == [
        ("first", "m/one", str(tmp_path / "g/x1.wav")), (str(a), "a", str(a))]
    missing = audio_inputs([str(tmp_path / "missing.wav")])  # kept: the worker reports it as its error row
    assert missing[0].payload == {"audio": str(tmp_path / "missing.wav")}


@pytest.mark.parametrize("specs, lines, message", [
    (["{tmp}/none/*.wav"], None, "matches no file"),
    (["{tmp}/empty"], None, "has no files ending in"),
    (["{tmp}/a.wav", "{tmp}/a.wav"], None, "two inputs have the id"),
    (["{tmp}/a.wav", "{tmp}/sub/a.wav"], None, "would both be written as a.*"),
    ([], ['{"audio": "a.wav", "id": 3}', '{"audio": "sub/a.wav", "id": "3"}'], "two inputs have the id '3'"),
    ([], ['{"path": "a.wav"}'], "m.jsonl:1: missing field 'audio'"),
    ([], ['["a.wav"]'], "m.jsonl:1: expected a path or an object"),
    ([], ["{nope"], "m.jsonl:1: not valid JSON"),
    ([], ['{"audio": ""}'], "field 'audio' must be a non-empty str"),
    ([], [], "the job has no inputs"),
])
def test_bad_inputs_fail_before_any_work_and_name_the_problem(tmp_path, specs, lines, message):
    touch(tmp_path / "a.wav")
    touch(tmp_path / "sub" / "a.wav")
    (tmp_path / "empty").mkdir()
    manifest = None if lines is None else touch(tmp_path / "m.jsonl", "\n".join(lines))
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("[", r"\[")):
        audio_inputs([s.format(tmp=tmp_path) for s in specs], manifest)


def test_text_and_prompt_inputs(tmp_path):
    doc = touch(tmp_path / "docs" / "a.txt", "A document.")
    manifest = touch(tmp_path / "m.jsonl", '{"text": "Inline text.", "id": "t1"}\n{"text": "More."}\n"docs/a.txt"\n')
    items = text_inputs([], manifest)
    assert [(i.id, i.payload) for i in items] == [("t1", {"text": "Inline text."}), ("2", {"text": "More."}),
                                                  (str(doc), {"path": str(doc)})]
    prompts = touch(tmp_path / "p.jsonl", '"one"\n\n{"prompt": "two", "sampling_params": {"max_tokens": 3}}\n')
    items = prompt_inputs(prompts, {"max_tokens": 8, "temperature": 0.0})
    assert [(i.id, i.payload) for i in items] == [
        ("0", {"prompt": "one", "params": {"max_tokens": 8, "temperature": 0.0}}),
        ("1", {"prompt": {"prompt": "two"}, "params": {"max_tokens": 3, "temperature": 0.0}})]
    bad = touch(tmp_path / "bad.jsonl", '"one"\n{"prompt": "two", "sampling_params": {"max_tokens": 0}}\n')
    with pytest.raises(ValueError, match="prompt 1: sampling_params: .*max_tokens"):
        prompt_inputs(bad, {})


def test_results_file_keeps_one_row_per_id_and_resume_keeps_only_complete_rows(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultsFile(path) as results:
        assert results.append({"id": "a", "text": "A", "error": None})
        assert not results.append({"id": "a", "text": "again", "error": None})  # a retried batch's copy
        results.append({"id": "b", "text": None, "error": "corrupt"})
        results.append({"id": "c", "text": "C", "error": None})
    with open(path, "a") as f:
        f.write('{"id": "d", "text": "torn')  # the driver was killed mid-line
    assert [r["id"] for r in read_rows(path)] == ["a", "b", "c"]
    # c's output files are gone: it is not complete, and runs again with b (an error row) and d
    resumed = ResultsFile(path, resume=True, complete=lambda row: row["id"] != "c")
    assert set(resumed.done) == {"a"}
    resumed.append({"id": "b", "text": "B", "error": None})
    resumed.close()
    assert [(r["id"], r["text"]) for r in read_rows(path)] == [("a", "A"), ("b", "B")]
    assert ResultsFile(path).done == {}  # without resume: a fresh file
    assert path.read_text() == ""
    with pytest.raises(ValueError, match="is a folder"):
        ResultsFile(tmp_path)


def test_write_atomically_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "out.txt"
    write_atomically(path, "old\n")

    with pytest.raises(TypeError):
        write_atomically(path, object())  # fails inside the write: nothing replaced, no temp file left
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    write_atomically(path, "new\n")
    assert path.read_text() == "new\n"
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_metrics_of_replicas_are_summed_and_listed_per_replica():
    text = ("# HELP encdec_requests_running Requests running\n# TYPE encdec_requests_running gauge\n"
            "encdec_requests_running {}\n"
            "# HELP encdec_http_requests_total API requests\n# TYPE encdec_http_requests_total counter\n"
            'encdec_http_requests_total{{endpoint="/v1/completions",status="200"}} {}\n'
            "# HELP encdec_replica_info The replica's process\n# TYPE encdec_replica_info gauge\n"
            'encdec_replica_info{{pid="{}"}} 1\n')
    merged = merge({"r1": text.format(2, 5, 11), "r2": text.format(1, 0.5, 12)}).splitlines()
    assert merged == [
        "# HELP encdec_requests_running Requests running", "# TYPE encdec_requests_running gauge",
        "encdec_requests_running 3", 'encdec_requests_running{replica="r1"} 2',
        'encdec_requests_running{replica="r2"} 1',
        "# HELP encdec_http_requests_total API requests", "# TYPE encdec_http_requests_total counter",
        'encdec_http_requests_total{endpoint="/v1/completions",status="200"} 5.5',
        'encdec_http_requests_total{replica="r1",endpoint="/v1/completions",status="200"} 5',
        'encdec_http_requests_total{replica="r2",endpoint="/v1/completions",status="200"} 0.5',
        "# HELP encdec_replica_info The replica's process", "# TYPE encdec_replica_info gauge",
        'encdec_replica_info{replica="r1",pid="11"} 1', 'encdec_replica_info{replica="r2",pid="12"} 1']


def test_ray_takes_an_address_only_when_one_follows():
    assert split_ray_address(["transcribe", "--ray", "a.wav"]) == ["transcribe", "--ray=", "a.wav"]
    assert split_ray_address(["transcribe", "a.wav", "--ray"]) == ["transcribe", "a.wav", "--ray="]
    assert split_ray_address(["transcribe", "--ray", "--num-workers", "2"])[1] == "--ray="
    for address in ("auto", "10.0.0.5:6379", "head-node:6379", "ray://head:10001", "[::1]:6379"):
        assert split_ray_address(["generate", "--ray", address, "p.jsonl"])[1:3] == ["--ray", address]
    args = build_parser().parse_args(split_ray_address(["transcribe", "--ray", "a.wav", "--num-workers", "2"]))
    assert (args.ray, args.audio, args.num_workers) == ("", ["a.wav"], 2)


@pytest.mark.parametrize("argv, message", [
    (["transcribe", "a.wav", "--num-workers", "2"], "--num-workers needs --ray"),
    (["transcribe", "a.wav", "--resume"], "--resume needs --ray"),
    (["summarize", "a.txt", "--model", "m", "--batch-size", "4"], "--batch-size needs --ray"),
    (["transcribe"], "the following arguments are required: audio"),
    (["transcribe", "--ray"], r"required: audio \(or --manifest\)"),
])
def test_ray_only_flags_are_refused_without_ray(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_a_worker_without_the_model_folder_says_where_it_looked(tmp_path):
    from encdec_engine.checkpoints.names import resolve_job_model

    with pytest.raises(FileNotFoundError, match=f"model folder {tmp_path}/gone does not exist on .*shared file system"):
        resolve_job_model(str(tmp_path / "gone"))


def test_a_missing_model_fails_before_a_cluster_starts(tmp_path, capsys):
    prompts = touch(tmp_path / "p.jsonl", '"one"\n')
    assert main(["generate", str(prompts), "--model", str(tmp_path / "gone"), "--ray"]) == 2
    assert f"model folder {tmp_path}/gone does not exist" in capsys.readouterr().err


BLOCK_RAY = ("import sys\nclass NoRay:\n    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'ray' or name.startswith('ray.'):\n            raise ImportError('no ray here')\n"
             "sys.meta_path.insert(0, NoRay())\n")


@pytest.mark.integration  # a subprocess of the engine
def test_the_package_imports_and_runs_without_ray(tmp_path):
    """The base install has no Ray: importing the package, the CLI and `distributed` must work, and a
    --ray command must say how to install Ray instead of a traceback."""
    code = BLOCK_RAY + (
        "import encdec_engine, encdec_engine.cli.main as cli, encdec_engine.distributed as d\n"
        "assert 'ray' not in sys.modules\n"
        f"sys.exit(cli.main(['transcribe', '--ray', {str(ROOT / 'prompts/audio/fox.wav')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "scaling out needs Ray" in r.stderr and "pip install 'encdec-engine[ray]'" in r.stderr
    assert list(tmp_path.iterdir()) == []  # refused before any output (results.jsonl) was written


def test_progress_counts_the_whole_job_and_the_audio_rate(tmp_path, monkeypatch, capsys):
    """The driver's bar: inputs done over all inputs (resumed ones start it), audio done and audio hours
    per hour; a second row for an id (a retried batch) is dropped, not counted. The cluster is faked."""
    from contextlib import nullcontext

    from encdec_engine.distributed import jobs
    from encdec_engine.distributed.cluster import ClusterOptions
    from encdec_engine.distributed.inputs import JobInput

    inputs = [JobInput(f"c{i}", {"audio": f"c{i}.wav"}, f"c{i}") for i in range(4)]
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"id": "c0", "text": "done before", "duration": 90.0, "error": None}) + "\n")
    row = lambda i: {"id": f"c{i}", "text": "t", "duration": 1800.0, "error": None}  # noqa: E731
    monkeypatch.setattr(jobs, "connect", lambda cluster: nullcontext(1))
    monkeypatch.setattr(jobs, "_stream", lambda job, pending, cluster, n: iter([row(1), row(2), row(1), row(3)]))
    job = jobs.Job("transcribe", inputs)
    rows = list(jobs.run(job, ClusterOptions(), jobs.Outputs(str(results), resume=True, unit="file")))
    assert [r["id"] for r in rows] == ["c0", "c1", "c2", "c3"]
    assert [r["id"] for r in read_rows(results)] == ["c0", "c1", "c2", "c3"]
    bar = capsys.readouterr().err.split("\r")[-1]
    assert "4/4" in bar and "audio 1.50 h" in bar and re.search(r"\d+\.\d h/h", bar), bar
