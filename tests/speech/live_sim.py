"""A deterministic driver for live sessions in tests: every stream gets its next 100 ms chunk at each tick,
and then every request due is decoded to the end before the next tick, as if the engine were infinitely
fast (all the streams' requests of a round run as one batch). Events come back tagged with the tick's
stream time, so a test can tell what was known when."""

from __future__ import annotations

import itertools

import numpy as np

from encdec_engine.speech.live.model import LiveModel
from encdec_engine.speech.live.options import LiveOptions
from encdec_engine.speech.live.session import LiveSession

CHUNK = 1600  # 100 ms at 16 kHz
_ids = itertools.count()


def simulate(engine, audios: list[np.ndarray], options: LiveOptions | None = None, chunk: int = CHUNK,
             commit_at_end: bool = True) -> list[list[tuple[float, object]]]:
    """[(stream seconds when it happened, event)] per stream. At the end each stream's open turn ends
    (LiveSession.finish) and every turn gets its final text."""
    model = LiveModel(engine)
    sessions = [LiveSession(model, options or LiveOptions()) for _ in audios]
    events: list[list[tuple[float, object]]] = [[] for _ in audios]
    longest = max(len(a) for a in audios)
    for start in range(0, longest + chunk, chunk):
        now = min(start + chunk, longest) / 16000
        for i, (session, audio) in enumerate(zip(sessions, audios)):
            if start < len(audio):
                events[i] += [(now, e) for e in session.append(audio[start : start + chunk])]
            elif start < len(audio) + chunk and commit_at_end:
                events[i] += [(now, e) for e in session.finish()]
        _decode_all(engine, sessions, events, now)
    return events


def _decode_all(engine, sessions: list[LiveSession], events: list[list], now: float) -> None:
    while True:
        requests = {}
        for i, session in enumerate(sessions):
            request = session.next_request()
            if request is not None:
                rid = f"sim-{next(_ids)}"
                engine.add_request(rid, request.prompt, request.params)
                requests[rid] = (i, request)
        if not requests:
            return
        while requests:
            for out in engine.step():
                if out.finished and out.request_id in requests:
                    i, request = requests.pop(out.request_id)
                    events[i] += [(now, e) for e in sessions[i].take_output(request, out)]
