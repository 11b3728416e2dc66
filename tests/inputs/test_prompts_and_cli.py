"""The example prompt files (every format) and the CLI, run the way a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from encdec_engine import SamplingParams
from encdec_engine.inputs.prompt_files import load_prompt_file, load_prompts_with_params
from encdec_engine.inputs.prompts import parse_prompt

ROOT = Path(__file__).resolve().parents[2]
TEXT_PROMPT_FILES = ["strings.jsonl", "text_prompts.jsonl", "token_prompts.jsonl", "explicit_prompts.jsonl"]


def test_parse_every_format():
    assert parse_prompt("hi").primary.kind == "text"
    assert parse_prompt({"prompt": "hi"}).primary.text == "hi"
    assert parse_prompt({"prompt_token_ids": [1, 2]}).primary.token_ids == [1, 2]
    p = parse_prompt({"encoder_prompt": {"prompt_token_ids": [1]}, "decoder_prompt": "x"})
    assert p.explicit and p.primary.token_ids == [1] and p.decoder.text == "x"
    assert parse_prompt({"encoder_prompt": "a", "decoder_prompt": None}).decoder is None


@pytest.mark.parametrize("name", TEXT_PROMPT_FILES)
def test_example_prompt_files_run(name, bart_path, make_llm):
    entries = load_prompt_file(ROOT / "prompts" / name)
    assert entries
    llm = make_llm(bart_path, num_kv_blocks=300)
    params = [SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **o}) for _, o in entries]
    outs = llm.generate([p for p, _ in entries], params, use_tqdm=False)
    assert all(o.finished and o.outputs[0].token_ids for o in outs)


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        load_prompt_file(bad)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompt_file(tmp_path / "missing.jsonl")


def test_prompt_file_sampling_params_errors_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('"one"\n\n{"prompt": "two", "sampling_params": {"bogus": 1}}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: prompt 1: sampling_params: unknown field 'bogus'"):
        load_prompts_with_params(path, {"max_tokens": 4})
    path.write_text('{"prompt": "x", "sampling_params": {"num_beams": 2, "temperature": 0.7}}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: prompt 0: sampling_params: .*beam search"):
        load_prompts_with_params(path, {})
    path.write_text('"one"\n{"prompt": "two", "sampling_params": {"max_tokens": 3}}\n')
    assert load_prompts_with_params(path, {"max_tokens": 8, "seed": None}) == [
        ("one", {"max_tokens": 8, "seed": None}), ({"prompt": "two"}, {"max_tokens": 3, "seed": None})]


def test_summarize_refuses_whisper_with_one_line(make_llm):
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    llm = make_llm(default_model_path(), kv_cache_space_gb=0.1)
    with pytest.raises(ValueError, match="whisper models do not summarize text"):
        llm.summarize(["Some notes."])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "encdec_engine.cli.main", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.mark.integration  # a subprocess of the engine
def test_cli_generate_and_summarize(bart_path, tmp_path):
    out_file = tmp_path / "out.jsonl"
    r = run_cli("generate", "prompts/explicit_prompts.jsonl", "--model", str(bart_path), "--max-tokens", "5",
                "--output", str(out_file), "--quiet")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(records) == 4 and all(len(rec["token_ids"]) <= 5 for rec in records)
    r = run_cli("summarize", "prompts/documents/council.txt", "prompts/documents/season.txt", "--model",
                str(bart_path), "--max-tokens", "6", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("== prompts/documents/") == 2
    r = run_cli("summarize", "nope.txt", "--model", str(bart_path))
    assert r.returncode == 2 and "nope.txt" in r.stderr


def test_summarize_uses_generation_config(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=300)
    gc = llm.engine.generation_config
    saved = gc.to_dict()
    gc.min_length, gc.max_length, gc.no_repeat_ngram_size, gc.forced_bos_token_id = 12, 20, 3, 0
    try:
        text = (ROOT / "prompts/documents/council.txt").read_text()
        summaries = llm.summarize([text])
        # HF counts the decoder start token in max_length 20 / min_length 12: 19 / 11 new tokens, BOS forced.
        ids = llm.get_tokenizer()(text, truncation=True, max_length=256)["input_ids"]
        outs = llm.generate([{"encoder_prompt": {"prompt_token_ids": ids}, "decoder_prompt": {"prompt_token_ids": [2]}}],
                            SamplingParams(temperature=0, max_tokens=19, min_tokens=11, no_repeat_ngram_size=3,
                                           forced_bos_token_id=0), use_tqdm=False)
        assert outs[0].outputs[0].token_ids[0] == 0
        assert summaries[0] == outs[0].outputs[0].text.strip()
    finally:
        for key in ("min_length", "max_length", "no_repeat_ngram_size", "forced_bos_token_id"):
            setattr(gc, key, saved.get(key))


def test_skip_tokenizer_init_works_on_token_ids_alone(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=300, skip_tokenizer_init=True)
    with_tok = make_llm(bart_path, num_kv_blocks=300)
    assert llm.get_tokenizer() is None
    prompt = {"prompt_token_ids": [0, 45, 120, 33, 2]}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    ref = with_tok.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids and out.text == ""
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)


def test_cli_generate_reports_failed_requests_and_exits_1(bart_path, make_llm, monkeypatch, capsys):
    from encdec_engine.cli import main as cli

    llm = make_llm(bart_path, num_kv_blocks=64)

    def failing_forward(inp):
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    monkeypatch.setattr(llm.engine.runner, "_forward", failing_forward)
    prompts = Path(__file__).resolve().parents[2] / "prompts" / "explicit_prompts.jsonl"
    rc = cli.main(["generate", str(prompts), "--model", str(bart_path), "--max-tokens", "3", "--quiet"])
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert rc == 1 and records and all(r["finish_reason"] == "error" and "injected" in r["error"] for r in records)
    assert err.count("failed: the model step running this request failed") == len(records)


def test_cli_generate_writes_every_sample_and_refuses_an_empty_file(bart_path, make_llm, monkeypatch, capsys, tmp_path):
    """With n > 1 every completion is in the record (only the first was written); a file of blank lines is
    an error (it exited 0 with no output)."""
    from encdec_engine.cli import main as cli

    llm = make_llm(bart_path, num_kv_blocks=64)
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello world", "sampling_params": {"n": 3, "temperature": 1.5, "seed": 0}}\n')
    assert cli.main(["generate", str(prompts), "--model", str(bart_path), "--max-tokens", "4", "--quiet"]) == 0
    record = json.loads(capsys.readouterr().out)
    expected = llm.generate(["hello world"], SamplingParams(n=3, temperature=1.5, seed=0, max_tokens=4),
                            use_tqdm=False)[0]
    assert [o["token_ids"] for o in record["outputs"]] == [list(c.token_ids) for c in expected.outputs]
    assert record["token_ids"] == record["outputs"][0]["token_ids"] and "error" not in record
    prompts.write_text("\n  \n")
    assert cli.main(["generate", str(prompts), "--model", str(bart_path), "--quiet"]) == 2
    assert capsys.readouterr().err == f"error: {prompts}: no prompts (every line is blank)\n"


@pytest.mark.integration  # a subprocess of the engine
def test_encdec_program_leaves_without_teardown_after_a_one_shot_command(tmp_path, monkeypatch):
    """`encdec transcribe` (the console script and `python -m`) ends with os._exit once its files are
    written: everything it wrote and printed is there, and the exit code is the command's."""
    r = run_cli("transcribe", "prompts/audio/weather.wav", "-o", str(tmp_path), "-f", "all")
    assert r.returncode == 0, r.stderr
    assert "beautiful day" in r.stdout
    assert json.loads((tmp_path / "weather.json").read_text())["text"].strip().startswith("Today is")
    assert {p.suffix for p in tmp_path.iterdir()} == {".json", ".srt", ".tsv", ".txt", ".vtt"}
    r = run_cli("transcribe", "nope.wav", "-o", str(tmp_path))
    assert r.returncode == 1 and "nope.wav" in r.stderr

    from encdec_engine.cli import main as cli

    assert cli._main(["transcribe", str(tmp_path / "missing.wav")]) == (1, True)
    exits = []
    monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append(code) or sys.exit(code))
    # run() turns on freezing what `loading` loads: not for the rest of this process's tests (objects frozen
    # at exit are never freed, and libtriton's nanobind lists each one then)
    monkeypatch.setattr(cli.args_module, "FREEZE_LOADED", cli.args_module.FREEZE_LOADED)
    for one_shot, profiled, expected in ((True, False, [3]), (False, False, []), (True, True, [])):
        exits.clear()
        monkeypatch.setattr(cli, "_main", lambda argv: (3, one_shot))
        monkeypatch.setattr(cli.sys, "getprofile", lambda: object() if profiled else None)
        with pytest.raises(SystemExit) as stop:
            cli.run()
        assert stop.value.code == 3 and exits == expected  # a profiler gets its normal exit to write results
