"""The `encdec` command line."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from encdec_engine.entrypoints.subtitles import SubtitleOptions


def _engine_args(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument("--model", required=model_required, help="checkpoint folder (or hub id when online)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-space-gb", type=float, default=None,
                   help="KV pool size (default: 2 GiB on CPU; on CUDA what --gpu-memory-utilization leaves)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: share of the device for weights, activations and the KV pool")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode eagerly, without CUDA graphs")


def _engine_kwargs(args) -> dict:
    """The EngineConfig fields every command takes (see _engine_args)."""
    return dict(dtype=args.dtype, device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                kv_cache_space_gb=args.kv_cache_space_gb, gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager)


def _llm(args):
    from encdec_engine import LLM

    return LLM(model=args.model, **_engine_kwargs(args))


def cmd_transcribe(args) -> int:
    from encdec_engine.entrypoints.writers import OUTPUT_FORMATS, output_basename, render, write_transcription

    from encdec_engine.speech.options import TranscribeOptions

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    options = {"timestamps": not args.without_timestamps, "initial_prompt": args.initial_prompt,
               "no_speech_threshold": args.no_speech_threshold, "beam_size": args.beam_size, "best_of": args.best_of,
               "word_timestamps": args.word_timestamps, "clip_timestamps": args.clip_timestamps,
               "hallucination_silence_threshold": args.hallucination_silence_threshold, "chunked": args.chunked,
               **_vad_options(args)}
    if args.temperature is not None:
        options["temperatures"] = (args.temperature,)
    TranscribeOptions(**options)  # bad values fail before the model loads
    writes = args.output_dir or args.output_format
    subtitles = _subtitle_options(args, writes=bool(writes))
    if writes:  # before any work: a bad destination must not cost the transcription
        out_dir = Path(args.output_dir or ".")
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"--output-dir {out_dir} exists and is not a directory")
        stems: dict[str, str] = {}
        for path in args.audio:
            other = stems.setdefault(output_basename(path), path)
            if other != path:
                raise ValueError(f"{other} and {path} would both be written as {output_basename(path)}.*; "
                                 "transcribe them into different --output-dir folders")
    if args.model is None:
        from encdec_engine.models.ct2_import import default_model_path

        args.model = str(default_model_path())
    elif _is_ct2_folder(args.model):
        from encdec_engine.models.ct2_import import import_ct2_whisper

        args.model = str(import_ct2_whisper(args.model, Path(args.model) / ".encdec-hf"))
    llm = _llm(args)
    results = llm.transcribe(args.audio, language=args.language, task=args.task, use_tqdm=not args.quiet,
                             max_in_flight=args.batch_size, **options)
    failed = 0
    for path, result in zip(args.audio, results):
        if result.error is not None:
            failed += 1
            print(f"error: {result.error}", file=sys.stderr)
            continue
        if args.output_dir or args.output_format:
            write_transcription(result, args.output_format or "all", args.output_dir or ".", path, subtitles)
        if not args.quiet or not (args.output_dir or args.output_format):
            header = f"== {path}\n" if len(args.audio) > 1 else ""
            print(header + (render(result, "txt") if not args.verbose else render(result, "vtt")), end="")
    return 1 if failed else 0


# --vad-* flag -> faster-whisper's vad_parameters name (speech/vad.py VadOptions)
VAD_FLAGS = {"vad_threshold": "threshold", "vad_neg_threshold": "neg_threshold",
             "vad_min_speech_duration_ms": "min_speech_duration_ms", "vad_max_speech_duration_s": "max_speech_duration_s",
             "vad_min_silence_duration_ms": "min_silence_duration_ms", "vad_speech_pad_ms": "speech_pad_ms"}


def _vad_options(args) -> dict:
    """--vad-filter and the --vad-* flags given as vad_filter and vad_parameters (flags left out keep
    faster-whisper's defaults); a --vad-* flag without --vad-filter would change nothing, so it is refused."""
    given = {name: getattr(args, flag) for flag, name in VAD_FLAGS.items() if getattr(args, flag) is not None}
    if given and not args.vad_filter:
        flags = ", ".join("--" + flag.replace("_", "-") for flag, name in VAD_FLAGS.items() if name in given)
        raise ValueError(f"{flags} {'needs' if len(given) == 1 else 'need'} --vad-filter")
    return {"vad_filter": args.vad_filter, "vad_parameters": given or None} if args.vad_filter else {}


def _subtitle_options(args, writes: bool) -> SubtitleOptions:
    """The srt/vtt layout flags as SubtitleOptions; like openai-whisper they need word timestamps, and
    flags that would change nothing are refused rather than ignored."""
    from encdec_engine.entrypoints.subtitles import SubtitleOptions

    subtitles = SubtitleOptions(highlight_words=args.highlight_words, max_line_width=args.max_line_width,
                                max_line_count=args.max_line_count, max_words_per_line=args.max_words_per_line)
    names = subtitles.set_options
    flags = ", ".join("--" + name.replace("_", "-") for name in names)
    if flags and not args.word_timestamps:
        raise ValueError(f"{flags} {'needs' if len(names) == 1 else 'need'} --word-timestamps")
    if flags and (not writes or args.output_format in ("txt", "tsv", "json")):
        raise ValueError(f"{flags} only shape srt and vtt files; add --output-format srt, vtt or all")
    return subtitles


def _is_ct2_folder(path: str) -> bool:
    from encdec_engine.models.ct2_import import is_ct2_model_dir

    return Path(path).is_dir() and is_ct2_model_dir(path)


def cmd_generate(args) -> int:
    from encdec_engine import SamplingParams
    from encdec_engine.inputs.prompt_files import load_prompt_file

    entries = load_prompt_file(args.prompts)
    base = dict(temperature=args.temperature, max_tokens=args.max_tokens, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed)
    params = [SamplingParams(**{**base, **overrides}) for _, overrides in entries]
    outs = _llm(args).generate([p for p, _ in entries], params, use_tqdm=not args.quiet)
    with open(args.output, "w") if args.output else nullcontext(sys.stdout) as sink:
        for out in outs:
            c = out.outputs[0]
            record = {"request_id": out.request_id, "text": c.text, "token_ids": c.token_ids,
                      "finish_reason": c.finish_reason}
            if out.error is not None:  # it failed alone; the others ran to the end
                record["error"] = out.error
                print(f"error: prompt {out.request_id} failed: {out.error}", file=sys.stderr)
            sink.write(json.dumps(record) + "\n")
    return 1 if any(out.error is not None for out in outs) else 0


def cmd_summarize(args) -> int:
    texts = []
    for name in args.files:
        path = Path(name)
        if not path.is_file():
            print(f"error: {path}: no such file", file=sys.stderr)
            return 2
        texts.append(path.read_text())
    overrides = {k: v for k, v in (("max_tokens", args.max_tokens), ("min_tokens", args.min_tokens)) if v is not None}
    summaries = _llm(args).summarize(texts, use_tqdm=not args.quiet, **overrides)
    for name, summary in zip(args.files, summaries):
        print(f"== {name}\n{summary}" if len(args.files) > 1 else summary)
    return 0


def cmd_serve(args) -> int:
    import os

    from encdec_engine.entrypoints.server import ServerLimits, run_server

    model = args.model
    if model is None:
        from encdec_engine.models.ct2_import import default_model_path

        model = str(default_model_path())
    elif _is_ct2_folder(model):
        from encdec_engine.models.ct2_import import import_ct2_whisper

        model = str(import_ct2_whisper(model, Path(model) / ".encdec-hf"))
    limits = ServerLimits(api_key=args.api_key or os.environ.get("ENCDEC_API_KEY") or None,
                          max_queue=args.max_queue, max_upload_mb=args.max_upload_mb,
                          max_audio_seconds=args.max_audio_seconds, protect_info=args.protect_info)
    engine = dict(_engine_kwargs(args), swap_space_gb=args.swap_space_gb,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                  seed=args.seed, enable_prefix_caching=not args.no_prefix_caching)
    run_server(model, host=args.host, port=args.port, limits=limits, served_model_name=args.served_model_name,
               shutdown_timeout=args.shutdown_timeout, log_level=args.log_level, **engine)
    return 0


def _add_serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (transcriptions or completions)")
    _engine_args(sv, model_required=False)
    sv.set_defaults(model=None)
    sv.add_argument("--swap-space-gb", type=float, default=0.0, help="CPU swap pool for preempted requests")
    sv.add_argument("--max-num-batched-tokens", type=int, default=None)
    sv.add_argument("--max-model-len", type=int, default=None, help="decoder positions")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--no-prefix-caching", action="store_true", help="recompute every encoder output and prefix")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None, help="the model id clients use (default: folder name)")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $ENCDEC_API_KEY, else none)")
    sv.add_argument("--protect-info", action=argparse.BooleanOptionalAction, default=None,
                    help="/metrics, /docs, /redoc and /openapi.json need the API key too (without a key: are "
                         "not served); default: on when an API key is set")
    sv.add_argument("--max-queue", type=int, default=256, help="requests waiting to start; beyond: 429")
    sv.add_argument("--max-upload-mb", type=float, default=25.0, help="request body limit; beyond: 413")
    sv.add_argument("--max-audio-seconds", type=float, default=3600.0, help="audio length limit; beyond: 413")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests get to finish on shutdown before they are aborted")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.set_defaults(func=cmd_serve)


def _optional_float(value: str) -> float | None:
    return None if value.lower() == "none" else float(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encdec", description="Serve encoder/decoder transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("transcribe", help="transcribe audio files with Whisper")
    tr.add_argument("audio", nargs="+", help="audio files (wav, flac, ogg, mp3, ...)")
    _engine_args(tr, model_required=False)
    tr.set_defaults(model=None)
    tr.add_argument("--language", default=None, help="e.g. en; default: detect (English-only models: en)")
    tr.add_argument("--task", default="transcribe", choices=["transcribe", "translate"])
    tr.add_argument("--output-format", default=None, choices=["txt", "vtt", "srt", "tsv", "json", "all"],
                    help="write <audio name>.<format> files (default with --output-dir: all)")
    tr.add_argument("--output-dir", default=None, help="where to write output files (default: .)")
    tr.add_argument("--batch-size", type=int, default=16, help="files transcribed concurrently")
    tr.add_argument("--temperature", type=float, default=None, help="one fixed temperature (no fallback)")
    tr.add_argument("--beam-size", type=int, default=1,
                    help="beams per window at temperature 0 (default 1: greedy; openai-whisper's CLI uses 5)")
    tr.add_argument("--best-of", type=int, default=5, help="samples per window at temperature > 0")
    tr.add_argument("--word-timestamps", action="store_true",
                    help="time each word (cross-attention alignment); JSON output lists them per segment")
    tr.add_argument("--highlight-words", action="store_true",
                    help="srt/vtt: one cue per word, the word underlined in its line (needs --word-timestamps)")
    tr.add_argument("--max-line-width", type=int, default=None,
                    help="srt/vtt: characters in a line before it breaks (needs --word-timestamps)")
    tr.add_argument("--max-line-count", type=int, default=None,
                    help="srt/vtt: lines per cue, cues then run across segments (needs --max-line-width)")
    tr.add_argument("--max-words-per-line", type=int, default=None,
                    help="srt/vtt: words per cue, within a segment (needs --word-timestamps; "
                         "not with --max-line-width)")
    tr.add_argument("--clip-timestamps", default="",
                    help="seconds start,end[,start,end...] of the parts to transcribe; an odd count runs to the end")
    tr.add_argument("--hallucination-silence-threshold", type=float, default=None,
                    help="seconds: skip silence this long around a probable hallucination (needs --word-timestamps)")
    tr.add_argument("--chunked", action="store_true",
                    help="cut audio over 30 s at quiet points and decode the windows at once (faster; no window "
                         "sees an earlier one's text)")
    tr.add_argument("--vad-filter", action="store_true",
                    help="Silero VAD first: decode only the speech (with --chunked: chunks of at most 30 s of "
                         "speech, at once); times stay on the audio's timeline")
    tr.add_argument("--vad-threshold", type=float, default=None,
                    help="speech probability at or above which a 32 ms frame is speech (default 0.5)")
    tr.add_argument("--vad-neg-threshold", type=float, default=None,
                    help="probability below which speech ends (default: threshold - 0.15)")
    tr.add_argument("--vad-min-speech-duration-ms", type=int, default=None,
                    help="drop speech shorter than this (default 0)")
    tr.add_argument("--vad-max-speech-duration-s", type=float, default=None,
                    help="split longer speech at its longest pause (default: no limit; with --chunked 30)")
    tr.add_argument("--vad-min-silence-duration-ms", type=int, default=None,
                    help="silence shorter than this does not end speech (default 2000; with --chunked and no "
                         "--vad-* flag 160)")
    tr.add_argument("--vad-speech-pad-ms", type=int, default=None,
                    help="audio kept on each side of the speech (default 400)")
    tr.add_argument("--without-timestamps", action="store_true", help="decode with <|notimestamps|>")
    tr.add_argument("--initial-prompt", default=None, help="text that conditions the first window")
    tr.add_argument("--no-speech-threshold", type=_optional_float, default=0.6,
                    help="skip a window whose no-speech probability is above this and whose text is improbable "
                         "(mean log-probability <= -1); 'none' never skips")
    tr.add_argument("--verbose", action="store_true", help="print timed segments (VTT) instead of text")
    tr.add_argument("--quiet", action="store_true", help="no progress bar; with output files, no stdout")
    tr.set_defaults(func=cmd_transcribe)

    gen = sub.add_parser("generate", help="run a JSONL file of prompts (any prompt format)")
    gen.add_argument("prompts", help="JSONL file: one prompt per line")
    _engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--output", help="write JSONL results here instead of stdout")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=cmd_generate)

    summ = sub.add_parser("summarize", help="summarize text files with the checkpoint's generation config")
    summ.add_argument("files", nargs="+")
    _engine_args(summ)
    summ.add_argument("--max-tokens", type=int, default=None)
    summ.add_argument("--min-tokens", type=int, default=None)
    summ.add_argument("--quiet", action="store_true")
    summ.set_defaults(func=cmd_summarize)

    _add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad arguments, unwritable outputs: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
