"""The OpenAI-compatible HTTP server over AsyncLLMEngine; started by `encdec serve` (cli/serve.py) and distributed/.

    app.py                    the app: routes, middleware, startup and shutdown over AsyncLLMEngine
    routes.py                 every path the server answers, written once
    info.py                   /v1/models, /health and /metrics
    completions.py            /v1/completions for text models, whole or streamed
    audio.py                  /v1/audio/transcriptions and /translations for Whisper
    uploads.py                an uploaded audio file on its way to a job, its memory accounted for
    realtime.py               /v1/realtime (websocket): OpenAI's Realtime transcription sessions
    realtime_protocol.py      the Realtime protocol's session configurations and events
    protocol.py               request and response schemas (pydantic)
    gate.py                   what every request passes first: Host and Origin, API key, body size and rate,
                              audio memory
    origins.py                which Host and Origin headers are served
    limits.py                 ServerLimits and the bookkeeping that enforces them
    state.py                  the state an app serves from, and the plumbing endpoints share (SSE, cancel)
    errors.py                 errors in OpenAI's {"error": {...}} shape
    metrics.py                Prometheus metrics: per-endpoint counters and latencies, engine gauges
    openapi.py                the OpenAPI document of the bodies the server really takes and gives
"""
