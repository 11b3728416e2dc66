"""`encdec serve`: its flags, the ServerLimits and engine fields they set, and running the server."""

from __future__ import annotations

import argparse

from encdec_engine.checkpoints.names import DEFAULT_MODEL
from encdec_engine.cli.args import (HelpFormatter, add_engine_args, api_key, check_engine_args, comma_list,
                                    engine_kwargs, resolve_model)


def cmd_serve(args) -> int:
    from encdec_engine.server.app import run_server  # lazy: FastAPI and the engine (1.5 s)

    check_engine_args(args)
    model = resolve_model(args)
    run_server(model, host=args.host, port=args.port, limits=server_limits(args),
               served_model_name=args.served_model_name, shutdown_timeout=args.shutdown_timeout,
               log_level=args.log_level, **server_engine_kwargs(args))
    return 0


def server_limits(args):
    """The ServerLimits the serve flags set (of the one server, or of each replica on Ray)."""
    from encdec_engine.server.limits import ServerLimits  # lazy: the server's modules (1.5 s)

    return ServerLimits(api_key=api_key(args.api_key, "ENCDEC_API_KEY"), allowed_hosts=args.allowed_hosts,
                        allowed_origins=args.allowed_origins or (),
                        max_queue=args.max_queue, max_upload_mb=args.max_upload_mb,
                        max_audio_seconds=args.max_audio_seconds, max_audio_memory_mb=args.max_audio_memory_mb,
                        max_client_audio_mb=args.max_client_audio_mb, min_body_kb_per_s=args.min_body_kb_per_s,
                        body_grace_s=args.body_grace_s, max_request_tokens=args.max_request_tokens,
                        protect_info=args.protect_info, max_realtime_sessions=args.max_realtime_sessions,
                        max_realtime_buffer_seconds=args.max_realtime_buffer_seconds,
                        max_realtime_speed=args.max_realtime_speed,
                        max_realtime_sessions_per_client=args.max_realtime_sessions_per_client,
                        realtime_idle_timeout_s=args.realtime_idle_timeout,
                        realtime_interim_padding_s=args.realtime_interim_padding,
                        without_timestamps=args.without_timestamps)


def server_engine_kwargs(args) -> dict:
    return dict(engine_kwargs(args), swap_space_gb=args.swap_space_gb,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                seed=args.seed, enable_prefix_caching=not args.no_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill)


def add_serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (transcriptions or completions)",
                        formatter_class=HelpFormatter)
    add_engine_args(sv, default_model=DEFAULT_MODEL)
    sv.add_argument("--swap-space-gb", type=float, default=0.0, help="CPU swap pool for preempted requests")
    sv.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="prefill tokens in one step (default: the model's encoder + decoder lengths, at least 16384)")
    sv.add_argument("--enable-chunked-prefill", action="store_true",
                    help="decodes first in every step, prompts a chunk per step in the tokens left")
    sv.add_argument("--max-model-len", type=int, default=None, help="decoder positions (default: the model's)")
    sv.add_argument("--seed", type=int, default=0, help="for unseeded sampling")
    sv.add_argument("--no-prefix-caching", action="store_true", help="recompute every encoder output and prefix")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (loopback only by default)")
    sv.add_argument("--port", type=int, default=8000, help="port to bind")
    sv.add_argument("--served-model-name", default=None, help="the model id clients use (default: folder name)")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $ENCDEC_API_KEY, else none; prefer "
                         "the variable: every user of the machine sees a flag in `ps`)")
    sv.add_argument("--protect-info", action=argparse.BooleanOptionalAction, default=None,
                    help="/metrics, /docs, /redoc and /openapi.json need the API key too (without a key: are "
                         "not served); default: on when an API key is set")
    sv.add_argument("--allowed-hosts", type=comma_list, default=None, metavar="NAMES",
                    help="Host header names served besides this machine's (localhost, 127.0.0.1, [::1]) and IP "
                         "addresses, comma-separated ('.example.com': it and its subdomains; '*': any), against DNS "
                         "rebinding; default: none more on a loopback --host, any on a public one")
    sv.add_argument("--allowed-origins", type=comma_list, default=None, metavar="ORIGINS",
                    help="web pages (Origin header, e.g. https://app.example.com) that may call the server besides "
                         "this machine's (http(s)://localhost, 127.0.0.1, [::1], any port) and its own, "
                         "comma-separated ('*': any); requests without an Origin (not from a browser) pass")
    sv.add_argument("--max-queue", type=int, default=256, help="requests waiting to start; beyond: 429")
    sv.add_argument("--max-upload-mb", type=float, default=25.0, help="request body limit; beyond: 413")
    sv.add_argument("--max-audio-seconds", type=float, default=3600.0, help="audio length limit; beyond: 413")
    sv.add_argument("--max-audio-memory-mb", type=float, default=4096.0,
                    help="memory for the audio of transcriptions in flight (uploads, samples, log-mels: about "
                         "350 MB per hour of audio), held from upload to the job's end; beyond: 429")
    sv.add_argument("--max-client-audio-mb", type=float, default=None,
                    help="what one client address may hold of that memory (default: a quarter, and at least what "
                         "the largest allowed upload holds while it decodes); beyond: 429")
    sv.add_argument("--min-body-kb-per-s", type=float, default=16.0,
                    help="the slowest a request body may arrive, on average after --body-grace-s; slower: 408")
    sv.add_argument("--body-grace-s", type=float, default=10.0, help="seconds before the body rate is enforced")
    sv.add_argument("--max-request-tokens", type=int, default=65536,
                    help="tokens one completion request may generate: prompts x best_of x max_tokens x "
                         "(1 + logprobs); beyond: 400")
    sv.add_argument("--max-realtime-sessions", type=int, default=32,
                    help="live transcription sessions (/v1/realtime) open at once; beyond: an error event and close "
                         "code 1013")
    sv.add_argument("--max-realtime-buffer-seconds", type=float, default=120.0,
                    help="audio one live session may hold not yet transcribed (its decodes fell behind); beyond: "
                         "an error event and close code 1013")
    sv.add_argument("--max-realtime-speed", type=float, default=4.0,
                    help="how fast a live session's audio may arrive (times real time) after its first "
                         "--max-realtime-buffer-seconds; a faster client is slowed, not refused")
    sv.add_argument("--max-realtime-sessions-per-client", type=int, default=None,
                    help="live sessions one client address may hold open (default: half of --max-realtime-sessions; "
                         "behind a proxy every client has its address); beyond: an error event and close code 1013")
    sv.add_argument("--realtime-idle-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="a live session that gets no client event for this long while it owes no transcription, "
                         "or whose client reads none of its events for this long, gets an error event and close "
                         "code 1008")
    sv.add_argument("--realtime-interim-padding", type=_padding, default=2.0, metavar="SECONDS|full",
                    help="what a live session's interim decodes (the deltas while a turn is spoken) read: the "
                         "buffered audio and this many seconds of padding (default 2), or 'full': the whole 30 s "
                         "window, as the final decode always does (costlier; see docs/live.md)")
    sv.add_argument("--without-timestamps", action="store_true",
                    help="answers without times (json, text, streams; no timestamp_granularities) decode with "
                         "<|notimestamps|>, as vLLM's server and HF's pipeline do; default: timestamp tokens, as "
                         "openai-whisper decodes (verbose_json, srt and vtt always do; see docs/server.md)")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests get to finish on shutdown before they are aborted")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                    help="server and engine log level")
    sv.set_defaults(func=cmd_serve)


def _padding(value: str) -> float | None:
    """--realtime-interim-padding: seconds in [0, 30], or 'full' (None: the whole window)."""
    if value == "full":
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'full', got {value!r}") from None
    if not 0 <= seconds <= 30:
        raise argparse.ArgumentTypeError(f"must be in [0, 30] seconds (or 'full'), got {value}")
    return seconds
