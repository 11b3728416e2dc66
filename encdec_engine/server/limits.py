"""The server's limits and the bookkeeping that enforces them: `ServerLimits` (every setting, validated),
the bounded queue of engine requests admitted but not yet running (`Admission`), the audio memory held by
the transcriptions in flight, in all and per client address (`AudioMemory`), the output budget of a
completion request, and the realtime sessions open (`RealtimeSessions`). A leaf: the gate (gate.py), the endpoints and the metrics use it; it uses none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from encdec_engine.server.errors import APIError
from encdec_engine.server.origins import ANY, check_host_entry, is_loopback, origin_key

_MB = 1 << 20


def client_address(scope) -> str:
    """What a per-client share is kept by: the peer's address in the ASGI scope ("" when unknown)."""
    client = scope.get("client")
    return client[0] if client else ""


@dataclass(frozen=True)
class ServerLimits:
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    # /metrics, /docs, /redoc and /openapi.json need the key too (without a key they are not served).
    # None: on when api_key is set.
    protect_info: bool | None = None
    # Host header names served besides this machine's (localhost, *.localhost, 127.0.0.1, [::1]) and IP
    # addresses, so that no web page reaches the server by DNS rebinding (origins.py); ".name": it and its
    # subdomains, "*": any. None: by the address bound (`for_bind`): none more on loopback, any on a public one.
    allowed_hosts: tuple[str, ...] | None = None
    # Web pages (Origin header: "https://app.example.com") served besides this machine's and the server's
    # own; "*": any. Requests without an Origin (every client that is not a browser) are not checked.
    allowed_origins: tuple[str, ...] = ()
    max_queue: int = 256  # engine requests admitted but not yet running; more get 429
    max_upload_mb: float = 25.0  # request body size (OpenAI's audio limit); more get 413
    max_audio_seconds: float = 3600.0  # decoded audio length; more get 413
    # Audio held by the transcriptions in flight (uploads as their bytes arrive, samples, log-mels: about
    # 350 MB per hour of audio), held until the job ends; more get 429.
    max_audio_memory_mb: float = 4096.0
    # What one client address may hold of that budget (None: a quarter of it, and at least what the largest
    # upload the other limits allow holds while it decodes: 1.7 GB for an hour of 48 kHz stereo).
    max_client_audio_mb: float | None = None
    # A body must arrive at this rate on average, after a grace period; slower gets 408.
    min_body_kb_per_s: float = 16.0
    body_grace_s: float = 10.0
    # Tokens one completion request may ask the engine for: prompts x best_of x max_tokens x (1 + logprobs).
    max_request_tokens: int = 65536
    # Audio decodes / log-mels computed at once (off the event loop), and the server's worker threads.
    preprocess_workers: int = 2
    # Realtime transcription sessions (/v1/realtime) open at once; the next client gets an error event and
    # the close code 1013 (try again later).
    max_realtime_sessions: int = 32
    # Audio one realtime session may hold in turns not yet transcribed to the end (seconds); a session
    # whose decodes fall that far behind gets an error event and is closed (1013).
    max_realtime_buffer_seconds: float = 120.0
    # How fast a realtime session's audio may arrive, in times real time, once its first
    # max_realtime_buffer_seconds are in: a faster client is slowed (its events are read later), so one
    # client cannot keep the event loop busy with audio work (resampling, voice detection) at any speed.
    max_realtime_speed: float = 4.0
    # Realtime sessions one client address may hold open of those (None: half, at least 1); the next gets an
    # error event and close code 1013. Behind a proxy every client has the proxy's address: raise it then.
    max_realtime_sessions_per_client: int | None = None
    # A realtime session that gets no client event for this long (seconds) while it owes the client no
    # transcription, or whose client reads none of its events for this long (its next events wait until it
    # does: see realtime.py), gets an error event and is closed (1008), so an idle client holds no session.
    realtime_idle_timeout_s: float = 60.0
    # What a realtime session's interim decodes read: the buffer and this much of the window's padding
    # (seconds; None: the whole 30 s window). LiveOptions.interim_padding_seconds.
    realtime_interim_padding_s: float | None = 2.0
    # Transcriptions and translations whose answer carries no times (json, text, and streams, without
    # timestamp_granularities) decode with <|notimestamps|>, as vLLM's server and HF's pipeline decode
    # short audio; verbose_json, srt, vtt and word timestamps still decode timed segments. False: every
    # request decodes as openai-whisper's transcribe() does (timestamp tokens).
    without_timestamps: bool = False

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.max_upload_mb <= 0 or self.max_audio_seconds <= 0:
            raise ValueError("max_upload_mb and max_audio_seconds must be positive")
        if self.max_audio_memory_mb < self.max_upload_mb:
            raise ValueError(f"max_audio_memory_mb ({self.max_audio_memory_mb:g}) must be at least max_upload_mb "
                             f"({self.max_upload_mb:g}): one upload must fit")
        if self.max_client_audio_mb is not None and not (
                self.max_upload_mb <= self.max_client_audio_mb <= self.max_audio_memory_mb):
            raise ValueError(f"max_client_audio_mb ({self.max_client_audio_mb:g}) must lie between max_upload_mb "
                             f"({self.max_upload_mb:g}) and max_audio_memory_mb ({self.max_audio_memory_mb:g})")
        if self.min_body_kb_per_s <= 0 or self.body_grace_s <= 0:
            raise ValueError("min_body_kb_per_s and body_grace_s must be positive")
        if self.max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be at least 1, got {self.max_request_tokens}")
        if self.preprocess_workers < 1:
            raise ValueError(f"preprocess_workers must be at least 1, got {self.preprocess_workers}")
        if self.max_realtime_sessions < 0:
            raise ValueError(f"max_realtime_sessions must be 0 (none) or more, got {self.max_realtime_sessions}")
        if not self.max_realtime_buffer_seconds >= 30:
            raise ValueError(f"max_realtime_buffer_seconds must be at least 30 (one Whisper window), got "
                             f"{self.max_realtime_buffer_seconds}")
        if not self.max_realtime_speed >= 1:
            raise ValueError(f"max_realtime_speed must be at least 1 (real time), got {self.max_realtime_speed}")
        per_client = self.max_realtime_sessions_per_client
        if per_client is not None and not 1 <= per_client <= max(1, self.max_realtime_sessions):
            raise ValueError(f"max_realtime_sessions_per_client must lie between 1 and max_realtime_sessions "
                             f"({self.max_realtime_sessions}), got {per_client}")
        padding = self.realtime_interim_padding_s
        if padding is not None and not 0 <= padding <= 30:
            raise ValueError(f"realtime_interim_padding_s must be in [0, 30] or None (the whole window), got {padding}")
        if not self.realtime_idle_timeout_s > 0:
            raise ValueError(f"realtime_idle_timeout_s must be positive, got {self.realtime_idle_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        if isinstance(self.allowed_hosts, str) or isinstance(self.allowed_origins, str):
            raise ValueError("allowed_hosts and allowed_origins are tuples of names, not one string")
        for host in self.allowed_hosts or ():
            check_host_entry(host)
        for origin in self.allowed_origins:
            if origin != ANY:
                origin_key(origin)

    def for_bind(self, host: str) -> ServerLimits:
        """These limits for a server bound to `host`: a public address (0.0.0.0, a LAN address) serves any
        Host unless `allowed_hosts` names some, since its clients reach it by names this server cannot know
        (its DNS names, a proxy's); a loopback one serves only this machine's names and `allowed_hosts`."""
        if self.allowed_hosts is None and not is_loopback(host):
            return replace(self, allowed_hosts=(ANY,))
        return self

    @property
    def protects_info(self) -> bool:
        return self.api_key is not None if self.protect_info is None else self.protect_info

    @property
    def realtime_sessions_per_client(self) -> int:
        """The realtime sessions one client address may hold: as set, or half of all (at least 1)."""
        if self.max_realtime_sessions_per_client is not None:
            return self.max_realtime_sessions_per_client
        return max(1, self.max_realtime_sessions // 2)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_upload_mb * _MB)

    def max_client_audio_bytes(self, largest_upload_bytes: int) -> int:
        """The per-client budget; by default a quarter of the whole, at least `largest_upload_bytes` (what one
        upload within the limits may hold while it decodes) and at most the whole."""
        if self.max_client_audio_mb is not None:
            return int(self.max_client_audio_mb * _MB)
        total = int(self.max_audio_memory_mb * _MB)
        return min(total, max(self.max_body_bytes, total // 4, largest_upload_bytes))


# -- admission: the bounded waiting queue -----------------------------------
class Ticket:
    """Slots held in the queue until the engine starts the requests (or they end)."""

    def __init__(self, admission: Admission, held: int) -> None:
        self.admission, self.held = admission, held

    def release(self, n: int = 1) -> None:
        n = min(n, self.held)
        self.held -= n
        self.admission.waiting -= n

    def release_all(self) -> None:
        self.release(self.held)

    def add(self, n: int) -> None:
        """Hold n more slots (more engine requests for the same client request); 429 if the queue is full."""
        self.admission.acquire(n)
        self.held += n


class Admission:
    """Counts engine requests admitted but not yet started (event loop only, so exact)."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.waiting = 0

    def acquire(self, n: int) -> Ticket:
        if n > self.max_queue:
            raise APIError(400, f"{n} prompts in one request exceed this server's queue of {self.max_queue}; "
                                "send fewer per request", "prompt")
        if self.waiting + n > self.max_queue:
            raise APIError(429, f"server busy: {self.waiting} requests are already waiting to start "
                                f"(limit {self.max_queue}); retry shortly")
        self.waiting += n
        return Ticket(self, n)


# -- the output budget of one request ------------------------------------------
def check_request_tokens(limits: ServerLimits, prompts: int, sequences: int, max_tokens: int,
                         logprobs: int | None) -> None:
    """400 when a request may make the engine generate (and the server hold and send) more than
    `max_request_tokens`: prompts x sequences per prompt (best_of) x max_tokens, each token counting
    1 + logprobs (the alternatives it carries)."""
    weight = 1 + (logprobs or 0)
    total = prompts * sequences * max_tokens * weight
    if total > limits.max_request_tokens:
        factors = f"{prompts} prompts x {sequences} sequences (n/best_of) x max_tokens {max_tokens}"
        if logprobs:
            factors += f" x (1 + logprobs {logprobs})"
        raise APIError(400, f"this request may generate {factors} = {total} tokens, more than this server's "
                            f"budget of {limits.max_request_tokens} per request; lower max_tokens, n/best_of or "
                            "logprobs, or send fewer prompts per request", "max_tokens")


# -- audio memory: bytes held by transcriptions in flight ---------------------
class Reservation:
    """Bytes one transcription holds in the server's `AudioMemory`: its upload as the bytes arrive, then
    the decode's peak, then the loaded job; released once (when the request ends)."""

    def __init__(self, memory: AudioMemory, client: str) -> None:
        self.memory, self.client, self.held = memory, client, 0
        self.arriving = True  # the body is still being received

    def grow(self, nbytes: int) -> None:
        self.resize(self.held + nbytes)

    def resize(self, nbytes: int) -> None:
        """Hold `nbytes` now (more or fewer than before); 429 if growing does not fit."""
        nbytes = max(0, nbytes)
        self.memory.take(self, nbytes - self.held)
        self.held = nbytes

    def arrived(self) -> None:
        if self.arriving:
            self.arriving = False
            self.memory.arriving -= self.held

    def release(self) -> None:
        self.resize(0)
        self.arrived()


class AudioMemory:
    """The byte budget of audio in flight, in all and per client address (event loop only, so exact)."""

    def __init__(self, limit_bytes: int, client_limit_bytes: int | None = None) -> None:
        self.limit, self.used = limit_bytes, 0
        self.client_limit = client_limit_bytes or limit_bytes
        self.by_client: dict[str, int] = {}
        self.arriving = 0  # bytes of bodies still being received (part of `used`)

    def reserve(self, client: str = "") -> Reservation:
        """An empty reservation for a request from `client` (its address)."""
        return Reservation(self, client)

    def take(self, reservation: Reservation, nbytes: int) -> None:
        client = reservation.client
        held = self.by_client.get(client, 0)
        alone = min(self.client_limit, self.limit)  # what one request may ever hold
        if nbytes > 0 and reservation.held + nbytes > alone:  # never fits: a retry would get the same
            raise APIError(413, f"decoding this upload would hold {_mb(reservation.held + nbytes)} of audio "
                                f"(its samples at their own rate and channels, then 16 kHz mono with its log-mel), "
                                f"more than this server lets one request hold ({_mb(alone)}); send it shorter, "
                                "or at a lower sample rate or in mono", "file")
        if nbytes > 0 and held + nbytes > self.client_limit:
            raise APIError(429, f"your address holds {_mb(held)} of audio in requests in flight; this one needs "
                                f"{_mb(nbytes)} more, over the per-client limit of {_mb(self.client_limit)}; "
                                "retry once your other requests have finished")
        if nbytes > 0 and self.used + nbytes > self.limit:
            raise APIError(429, f"server busy: requests in flight hold {_mb(self.used)} of audio ({_mb(self.arriving)} "
                                f"of it in uploads still arriving); this one needs {_mb(nbytes)} more, over the "
                                f"limit of {_mb(self.limit)}; retry shortly")
        self.used += nbytes
        if reservation.arriving:
            self.arriving += nbytes
        if held + nbytes:
            self.by_client[client] = held + nbytes
        else:
            self.by_client.pop(client, None)


def _mb(nbytes: int) -> str:
    return f"{nbytes / _MB:.1f} MB"


# -- realtime sessions: the websocket transcription sessions open ------------------
class SessionRefused(APIError):
    """A realtime session refused over a limit; `code` names which (the error event's code)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(429, message)
        self.code = code


class RealtimeSessions:
    """Realtime sessions open, at most `limit` in all and `client_limit` per client address (event loop
    only, so exact), and what became of them."""

    def __init__(self, limit: int, client_limit: int | None = None) -> None:
        self.limit, self.open = limit, 0
        self.client_limit = limit if client_limit is None else client_limit
        self.by_client: dict[str, int] = {}
        # refused: over the limit; refused_client: over the client's share; overflowed: closed over their
        # buffer bound; idle: closed after no client event; not_reading: closed, their client read no event
        self.outcomes = {"accepted": 0, "refused": 0, "refused_client": 0, "overflowed": 0, "idle": 0,
                         "not_reading": 0}
        self.dropped_seconds = 0.0  # audio the overflowed sessions held when they were closed

    def acquire(self, client: str = "") -> None:
        """Count one more session open for `client` (its address); SessionRefused (an error event and close
        code 1013) over the client's share or over the limit."""
        if self.open >= self.limit:
            self.outcomes["refused"] += 1
            raise SessionRefused(f"server busy: {self.open} realtime sessions are open (limit {self.limit}, "
                                 "--max-realtime-sessions); retry shortly", "session_limit_reached")
        held = self.by_client.get(client, 0)
        if held >= self.client_limit:
            self.outcomes["refused_client"] += 1
            raise SessionRefused(f"your address holds {held} realtime sessions open, this server's share per client "
                                 f"(--max-realtime-sessions-per-client {self.client_limit}); close one first, or "
                                 "retry once one has ended", "client_session_limit_reached")
        self.open += 1
        self.by_client[client] = held + 1
        self.outcomes["accepted"] += 1

    def release(self, client: str = "") -> None:
        self.open -= 1
        held = self.by_client.pop(client) - 1
        if held:
            self.by_client[client] = held

    def timed_out(self, outcome: str) -> None:
        """A session was closed by the idle timeout: `outcome` "idle" or "not_reading"."""
        self.outcomes[outcome] += 1

    def overflowed(self, seconds: float) -> None:
        """A session was closed holding `seconds` of audio over its buffer bound (that audio is dropped)."""
        self.outcomes["overflowed"] += 1
        self.dropped_seconds += seconds
