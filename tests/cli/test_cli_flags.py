"""`encdec` flags as openai-whisper users type them, and everything refused before a model loads.

None of these transcribes: the engine is patched to fail if it is ever built (no weights read).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from encdec_engine.cli.main import build_parser, main
from encdec_engine.cli.args import normalize_argv
from encdec_engine.cli.transcribe_args import temperatures, transcribe_options

ROOT = Path(__file__).resolve().parents[2]
CLIP = str(ROOT / "prompts" / "audio" / "fox.wav")
HEAVY = ("torch", "numpy", "transformers", "tqdm")


def parse(*argv: str):
    parser = build_parser()
    return parser.parse_args(normalize_argv(parser, list(argv)))


@pytest.mark.integration  # a subprocess of the engine
def test_help_is_fast_and_imports_no_torch():
    """`encdec --help` and `encdec transcribe --help` answer without importing torch or the engine; the
    bound on the wall time (Python's own start-up included) is loose, the measured time is printed."""
    cmd = [sys.executable, "-m", "encdec_engine.cli.main"]
    for args in (["--help"], ["transcribe", "--help"]):
        start = time.perf_counter()
        r = subprocess.run(cmd + args, capture_output=True, text=True, timeout=60)
        seconds = time.perf_counter() - start
        print(f"encdec {' '.join(args)}: {seconds:.3f} s")
        assert r.returncode == 0 and "usage: encdec" in r.stdout, r.stderr
        assert seconds < 5.0  # 0.1-0.2 s on an idle machine; loose for loaded CI runners
    probe = ("import sys\nfrom encdec_engine.cli.main import main\n"
             "for argv in (['--help'], ['transcribe', '--help'], ['--version']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             f"print({HEAVY!r} and sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_version_and_help_texts_show_every_default(capsys):
    from encdec_engine import __version__

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"encdec {__version__}"
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "transcribe" in a.choices).choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help text"
            text = sub._get_formatter()._expand_help(action) if action.option_strings else action.help
            unset = action.default is None or action.default is False or action.dest == "help"
            if action.option_strings and not unset:
                assert "default" in text, f"{name} {action.option_strings}: {text}"
    transcribe_help = subparsers["transcribe"].format_help()
    assert "(default: tiny.en)" in " ".join(transcribe_help.split())
    assert "--output-dir OUTPUT_DIR, -o OUTPUT_DIR" in transcribe_help and "-f {txt" in transcribe_help


# openai-whisper's own flags (whisper/transcribe.py cli()) with values as its README and --help write them.
OPENAI_WHISPER_ARGV = [
    "a.wav", "--model", "tiny.en", "--model_dir", "/tmp/models", "--device", "cpu", "--output_dir", "subs",
    "--output_format", "srt", "--verbose", "False", "--task", "transcribe", "--language", "English",
    "--temperature", "0", "--best_of", "5", "--beam_size", "5", "--patience", "1", "--length_penalty", "0.5",
    "--suppress_tokens", "-1", "--initial_prompt", "Hello.", "--carry_initial_prompt", "True",
    "--condition_on_previous_text", "False", "--fp16", "False", "--temperature_increment_on_fallback", "0.2",
    "--compression_ratio_threshold", "2.4", "--logprob_threshold", "-1.0", "--no_speech_threshold", "0.6",
    "--word_timestamps", "True", "--prepend_punctuations", "\"'“¿([{-", "--append_punctuations", "\"'.。,，!！?？:：”)]}、",
    "--highlight_words", "True", "--max_line_width", "None", "--max_line_count", "None", "--max_words_per_line",
    "None", "--threads", "0", "--clip_timestamps", "0", "--hallucination_silence_threshold", "None",
]


def test_openai_whisper_flags_parse_to_ours():
    args = parse("transcribe", *OPENAI_WHISPER_ARGV)
    assert (args.model, args.model_dir, args.output_dir, args.output_format) == ("tiny.en", "/tmp/models", "subs", "srt")
    assert (args.verbose, args.beam_size, args.best_of, args.patience, args.length_penalty) == (False, 5, 5, 1.0, 0.5)
    assert (args.carry_initial_prompt, args.condition_on_previous_text, args.fp16) == (True, False, False)
    assert (args.word_timestamps, args.highlight_words, args.max_line_width, args.threads) == (True, True, None, 0)
    assert args.hallucination_silence_threshold is None and args.clip_timestamps == "0"
    options = transcribe_options(args, temperatures(args))
    assert options.language == "en" and options.temperatures == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert (options.carry_initial_prompt, options.patience, options.suppress_tokens) == (True, 1.0, (-1,))
    assert (options.prepend_punctuations, options.append_punctuations) == ("\"'“¿([{-", "\"'.。,，!！?？:：”)]}、")
    assert (options.length_penalty, options.beam_size, options.condition_on_previous_text) == (0.5, 5, False)
    # Dashed spellings, bare booleans, short forms and openai-whisper's "None" give the same namespace.
    ours = parse("transcribe", "a.wav", "-o", "subs", "-f", "srt", "--word-timestamps", "--carry-initial-prompt",
                 "--no-condition-on-previous-text", "--no-fp16", "--beam-size", "none")
    assert (ours.output_dir, ours.output_format, ours.word_timestamps, ours.carry_initial_prompt) == \
        ("subs", "srt", True, True)
    assert (ours.condition_on_previous_text, ours.fp16, ours.beam_size) == (False, False, None)
    # A boolean flag followed by a file is still a bare flag; `=` spellings work too.
    args = parse("transcribe", "--word_timestamps", "a.wav", "--verbose=True", "--fp16=True")
    assert (args.audio, args.word_timestamps, args.verbose, args.fp16) == (["a.wav"], True, True, True)


def test_defaults_are_openai_whispers_output_defaults():
    args = parse("transcribe", "a.wav")
    assert (args.model, args.output_dir, args.output_format, args.threads) == ("tiny.en", ".", "all", 0)
    assert (args.condition_on_previous_text, args.suppress_tokens, args.temperature_increment_on_fallback) == \
        (True, "-1", 0.2)
    assert parse("serve").model == "tiny.en"


@pytest.mark.parametrize("start,step", [(0.0, 0.2), (0.5, 0.2), (0.0, 0.25), (0.3, 0.1), (1.0, 0.2), (0.0, 0.3)])
def test_temperature_schedule_is_openai_whispers(start, step):
    args = parse("transcribe", "a.wav", "--temperature", str(start), "--temperature_increment_on_fallback", str(step))
    expected = np.arange(start, 1.0 + 1e-6, step)  # openai-whisper's cli()
    assert temperatures(args) == pytest.approx(tuple(expected), abs=1e-9)
    args = parse("transcribe", "a.wav", "--temperature", str(start), "--temperature_increment_on_fallback", "None")
    assert temperatures(args) == (start,)


@pytest.fixture
def no_engine(monkeypatch):
    """Building an engine fails the test: a refusal must come before any weights are read."""
    from encdec_engine.engine.llm_engine import LLMEngine

    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built (the model loaded) before the input was refused")

    monkeypatch.setattr(LLMEngine, "__init__", refuse)


def test_bad_inputs_are_refused_before_the_model_loads(no_engine, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cases = [
        (["--language", "xx"], "'xx' is not a language Whisper knows; give a code (af, am, ar"),
        (["--language", "de"], "tiny.en is English-only: it cannot transcribe language 'de'"),
        (["--task", "translate"], "tiny.en is English-only: it cannot translate"),
        (["--verbose", "--quiet"], "give one of them"),
        (["--fp16", "True", "--dtype", "bfloat16"], "--fp16 True and --dtype bfloat16 disagree"),
        (["--carry_initial_prompt", "True"], "carry_initial_prompt needs an initial_prompt"),
        (["--patience", "2"], "patience needs beam_size of at least 2"),
        (["--beam_size", "5", "--length_penalty", "2"], "length_penalty (alpha) must be between 0 and 1"),
        (["--suppress_tokens", "a,b"], "suppress_tokens must be comma-separated token ids"),
        (["--suppress_tokens", "-2"], "suppress_tokens must be token ids of at least 0"),
        (["--append_punctuations", "."], "append_punctuations needs word_timestamps=True"),
        (["--temperature_increment_on_fallback", "0"], "must be above 0 (or none: no fallback)"),
        (["--temperature", "-1"], "--temperature must be 0 or more"),
        (["--threads", "-1"], "--threads must be 0"),
        (["--model", "base", "--model_dir", str(tmp_path)], "model 'base' is not on this machine"),
        (["--output_dir", CLIP], "exists and is not a directory"),
    ]
    for args, message in cases:
        assert main(["transcribe", CLIP, "--quiet", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (args, err)
    # A model that is not here says where it looked and what is available.
    main(["transcribe", CLIP, "--model", "base", "--model_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert str(tmp_path / "whisper-base") in err and "openai/whisper-base" in err and "Available: tiny.en" in err


def test_unreadable_files_are_reported_up_front(no_engine, tmp_path, capsys):
    """Missing files and folders are named at once; with none readable, nothing loads and the exit is 1."""
    missing, folder = str(tmp_path / "missing.mp3"), str(tmp_path)
    assert main(["transcribe", missing, folder, "--quiet", "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {missing}: no such file", f"error: {folder}: is a directory, not an audio file",
                   "error: no readable audio file among 2"]
    assert not (tmp_path / "out").exists()


def test_files_in_no_audio_format_are_reported_before_the_model_loads(no_engine, tmp_path, capsys):
    """A text file and a playlist were refused only once read, after the model had loaded: their first
    bytes tell (libsndfile's header, else ffmpeg's sniffing, as loading tries them) before anything loads."""
    notes, playlist = tmp_path / "notes.wav", tmp_path / "list.m4a"
    notes.write_text("these are my notes\n")
    playlist.write_text("ffconcat version 1.0\nfile a.wav\n")
    assert main(["transcribe", str(notes), str(playlist), "--quiet", "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"error: {notes} is not in an audio format this engine decodes (WAV, ")
    assert err[1:] == [f"error: {playlist} is an ffconcat playlist, not audio: files that refer to other files "
                       "or URLs are refused", "error: no readable audio file among 2"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_a_file_without_read_permission_is_reported(no_engine, tmp_path, capsys):
    locked = tmp_path / "locked.wav"
    locked.write_bytes(Path(CLIP).read_bytes())
    locked.chmod(0)
    assert main(["transcribe", str(locked), "--quiet"]) == 1
    assert "locked.wav: not readable (permission denied)" in capsys.readouterr().err


@pytest.mark.integration  # a subprocess of the engine
def test_refusals_import_no_torch():
    """The checks on flags, values and files run before torch is even imported."""
    probe = ("import sys\nfrom encdec_engine.cli.main import main\n"
             f"clip = {CLIP!r}\n"
             "codes = [main(['transcribe', clip, *a]) for a in (['--language', 'xx'], ['--patience', '2'],\n"
             "         ['--verbose', '--quiet'], ['--clip_timestamps', '5,2'])]\n"
             "codes.append(main(['transcribe', '/no/such.wav']))\n"
             "print(codes, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "[2, 2, 2, 2, 1] False", r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 6


def test_engine_flags_reach_the_engine_config():
    from encdec_engine.cli.args import engine_kwargs

    kwargs = engine_kwargs(parse("transcribe", "a.wav", "--threads", "3", "--dtype", "float32"))
    assert (kwargs["threads"], kwargs["dtype"]) == (3, "float32")
    assert engine_kwargs(parse("serve", "--threads", "0"))["threads"] is None  # 0: the default count


def test_fp16_is_openai_whispers(capsys, monkeypatch):
    """--fp16 True: float16 on CUDA; on the CPU openai-whisper warns and runs float32, as here. Unset: --dtype."""
    import torch

    from encdec_engine.cli.transcribe import transcribe_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert transcribe_dtype(parse("transcribe", "a.wav", "--fp16", "True")) == "float32"
    assert capsys.readouterr().err == "warning: --fp16 is not supported on the CPU; using float32 instead\n"
    assert transcribe_dtype(parse("transcribe", "a.wav", "--fp16", "True", "--device", "cuda")) == "float16"
    assert transcribe_dtype(parse("transcribe", "a.wav", "--fp16", "False")) == "float32"
    assert transcribe_dtype(parse("transcribe", "a.wav", "--dtype", "bfloat16")) == "bfloat16"
    assert capsys.readouterr().err == ""


def test_an_empty_file_and_a_bad_choice_are_one_line_each(no_engine, tmp_path, capsys):
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    assert main(["transcribe", str(empty), "--quiet", "-o", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: {empty}: the file is empty (0 bytes)",
                                                     "error: no readable audio file among 1"]
    with pytest.raises(SystemExit) as e:  # it used to print the whole 50-line usage above the error
        main(["transcribe", CLIP, "-f", "docx"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: encdec transcribe: argument --output-format/-f: invalid choice: 'docx' (choose from 'txt', 'vtt', "
        "'srt', 'tsv', 'json', 'all') (see encdec transcribe --help)"]


def test_an_output_folder_that_cannot_be_made_is_named_before_the_model_loads(no_engine, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where a parent folder would have to be
    out = blocker / "out"
    assert main(["transcribe", CLIP, "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err  # it was a bare "[Errno 20] Not a directory: ..."
    assert err.startswith(f"error: --output-dir {out}: cannot create it (") and err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["transcribe", CLIP, "--bogus"], "error: encdec transcribe: unrecognized arguments: --bogus "
                                      "(see encdec transcribe --help)"),
    (["transcribe"], "error: encdec transcribe: the following arguments are required: audio "
                     "(see encdec transcribe --help)"),
    (["summarize", "--model", "m"], "error: encdec summarize: the following arguments are required: files "
                                    "(see encdec summarize --help)"),
])
def test_refusals_name_the_subcommand(argv, message, capsys):
    """They said `encdec: ... (see encdec --help)`, whose help does not list the subcommand's flags."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [message]


@pytest.mark.parametrize("freeze", [False, True])
def test_loading_pauses_the_collector_and_restores_it_even_when_the_load_fails(monkeypatch, freeze):
    """`loading` (around every command's model load) turns Python's cyclic collector off and back on,
    also when the load raises; only the `encdec` program (FREEZE_LOADED) freezes what was loaded."""
    import gc

    from encdec_engine.cli import args as cli_args

    monkeypatch.setattr(cli_args, "FREEZE_LOADED", freeze)
    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(OSError), cli_args.loading():
            assert not gc.isenabled()
            loaded = [[] for _ in range(1000)]  # noqa: F841 (tracked objects that a freeze moves)
            raise OSError("the checkpoint is unreadable")
        assert gc.isenabled()
        assert (gc.get_freeze_count() > frozen) == freeze
    finally:
        gc.unfreeze()
        gc.enable()
    gc.disable()
    with cli_args.loading():
        pass
    assert not gc.isenabled()  # a collector that was off stays off
    gc.enable()
