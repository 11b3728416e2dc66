"""The server's Prometheus metrics: per-endpoint request counters and latency histograms, rendered
as text together with the engine's gauges and counters."""

from __future__ import annotations

import math
from collections import defaultdict

from encdec_engine.engine.async_engine import AsyncLLMEngine
from encdec_engine.server.limits import Admission, AudioMemory, RealtimeSessions

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, math.inf)  # s
_LAG_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, math.inf)  # s


class Metrics:
    """Requests answered and their latency, per API endpoint (updated by the gate)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (endpoint, status) -> count
        self.buckets: dict[str, list[int]] = defaultdict(lambda: [0] * len(_LATENCY_BUCKETS))
        self.latency_sum: dict[str, float] = defaultdict(float)
        # Realtime sessions: the lag of each decode (from the arrival of its window's last audio to its result),
        # the audio received, and the transcript events sent.
        self.realtime_lag = [0] * len(_LAG_BUCKETS)
        self.realtime_lag_sum = 0.0
        self.realtime_audio_seconds = 0.0
        self.realtime_events = {"delta": 0, "completed": 0}

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests[(endpoint, status)] += 1
        counts = self.buckets[endpoint]
        for i, bound in enumerate(_LATENCY_BUCKETS):
            if seconds <= bound:
                counts[i] += 1
        self.latency_sum[endpoint] += seconds

    def observe_realtime_lag(self, seconds: float) -> None:
        for i, bound in enumerate(_LAG_BUCKETS):
            if seconds <= bound:
                self.realtime_lag[i] += 1
        self.realtime_lag_sum += seconds

    def render(self, engine: AsyncLLMEngine, admission: Admission, audio_memory: AudioMemory | None = None,
               realtime: RealtimeSessions | None = None, live_sessions=()) -> str:
        s = engine.snapshot
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            out.extend(f"{name}{labels} {prometheus_number(value)}" for labels, value in samples)

        metric("encdec_engine_up", "gauge", "1 while the engine thread runs", [("", float(engine.is_running))])
        metric("encdec_requests_waiting", "gauge", "Requests in the engine's waiting queue", [("", s.num_waiting)])
        metric("encdec_requests_running", "gauge", "Requests in the engine's running batch", [("", s.num_running)])
        metric("encdec_requests_swapped", "gauge", "Requests swapped out to CPU memory", [("", s.num_swapped)])
        metric("encdec_server_queue_size", "gauge", "Requests admitted but not yet started (429 at the limit)",
               [("", admission.waiting)])
        metric("encdec_server_queue_limit", "gauge", "The admission queue's limit", [("", admission.max_queue)])
        if audio_memory is not None:
            metric("encdec_audio_memory_bytes", "gauge", "Audio held by transcriptions in flight (uploads, samples, "
                   "log-mels), and the limit (429 beyond it)",
                   [('{kind="used"}', audio_memory.used), ('{kind="limit"}', audio_memory.limit)])
        metric("encdec_kv_blocks_used", "gauge", "KV cache blocks in use, by attention type",
               [('{kind="self"}', s.self_blocks), ('{kind="cross"}', s.cross_blocks)])
        metric("encdec_kv_blocks_free", "gauge", "Free KV cache blocks, by pool",
               [('{pool="device"}', s.free_blocks), ('{pool="swap"}', s.free_swap_blocks)])
        metric("encdec_kv_blocks_total", "gauge", "KV cache blocks, by pool",
               [('{pool="device"}', s.total_blocks), ('{pool="swap"}', s.total_swap_blocks)])
        metric("encdec_generated_tokens_total", "counter", "Tokens generated", [("", s.generated_tokens)])
        metric("encdec_generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s",
               [("", round(engine.tokens_per_second(), 3))])
        metric("encdec_requests_aborted_total", "counter", "Engine requests aborted before finishing",
               [("", s.num_aborted)])
        metric("encdec_engine_step_errors_total", "counter", "Engine steps that raised", [("", s.num_step_errors)])
        metric("encdec_engine_busy_seconds_total", "counter", "Seconds the engine thread spent in steps (its rate "
               "is the engine's busy share; the rest it waited for work)", [("", round(s.step_seconds, 3))])
        if s.cache_stats:
            metric("encdec_prefix_cache_total", "counter", "Prefix cache lookups and hits (cross: whole encoder "
                   "outputs; self: decoder prefix blocks)", [(f'{{event="{k}"}}', v) for k, v in s.cache_stats])
        if realtime is not None:
            self._render_realtime(metric, out, realtime, live_sessions)
        metric("encdec_http_requests_total", "counter", "API requests answered, by endpoint and status",
               [(f'{{endpoint="{e}",status="{c}"}}', n) for (e, c), n in sorted(self.requests.items())])
        out.extend(["# HELP encdec_request_latency_seconds API request latency (to the last byte)",
                    "# TYPE encdec_request_latency_seconds histogram"])
        for endpoint, counts in sorted(self.buckets.items()):
            for bound, count in zip(_LATENCY_BUCKETS, counts):
                le = "+Inf" if bound == math.inf else f"{bound:g}"
                out.append(f'encdec_request_latency_seconds_bucket{{endpoint="{endpoint}",le="{le}"}} {count}')
            out.append(f'encdec_request_latency_seconds_sum{{endpoint="{endpoint}"}} '
                       f'{prometheus_number(self.latency_sum[endpoint])}')
            out.append(f'encdec_request_latency_seconds_count{{endpoint="{endpoint}"}} {counts[-1]}')
        return "\n".join(out) + "\n"

    def _render_realtime(self, metric, out: list[str], realtime: RealtimeSessions, live_sessions) -> None:
        backlog = max((s.backlog_seconds for s in live_sessions), default=0.0)
        metric("encdec_realtime_sessions", "gauge", "Realtime transcription sessions open, and the limit (beyond it: "
               "an error event and close code 1013)", [('{kind="open"}', realtime.open), ('{kind="limit"}', realtime.limit)])
        metric("encdec_realtime_sessions_total", "counter", "Realtime sessions accepted, refused (over the limit, or "
               "over the client's share: refused_client), closed over their buffer bound (overflowed), closed by the "
               "idle timeout (idle: no client event; not_reading: the client read none of the server's)",
               [(f'{{outcome="{k}"}}', v) for k, v in realtime.outcomes.items()])
        metric("encdec_realtime_dropped_audio_seconds_total", "counter", "Audio held by sessions closed over their "
               "buffer bound (no other audio is ever dropped)", [("", round(realtime.dropped_seconds, 3))])
        metric("encdec_realtime_audio_seconds_total", "counter", "Audio received by realtime sessions",
               [("", round(self.realtime_audio_seconds, 3))])
        metric("encdec_realtime_backlog_seconds", "gauge", "The most audio one open session holds that no decode has "
               "covered yet (grows when the engine falls behind)", [("", round(backlog, 3))])
        metric("encdec_realtime_events_total", "counter", "Transcript events sent: deltas (confirmed text) and "
               "completed turns", [(f'{{type="{k}"}}', v) for k, v in self.realtime_events.items()])
        out.extend(["# HELP encdec_realtime_lag_seconds Wall time from the arrival of a decoded window's last audio "
                    "to the decode's result", "# TYPE encdec_realtime_lag_seconds histogram"])
        for bound, count in zip(_LAG_BUCKETS, self.realtime_lag):
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            out.append(f'encdec_realtime_lag_seconds_bucket{{le="{le}"}} {count}')
        out.append(f"encdec_realtime_lag_seconds_sum {prometheus_number(self.realtime_lag_sum)}")
        out.append(f"encdec_realtime_lag_seconds_count {self.realtime_lag[-1]}")


def prometheus_number(value: float) -> str:
    """Exact Prometheus sample text: integers in full (no 1.23e+06), floats round-trip."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
