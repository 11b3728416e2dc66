"""Voice activity detection with Silero VAD (the `silero-vad` package ships its model), batched.

Silero VAD reads 16 kHz audio in 32 ms frames (512 samples, plus the 64 samples before them as
context). Its network is a stateless front (an STFT and four convolutions) and a recurrent tail
(one LSTM cell whose state runs through the recording, then a linear head). `get_speech_timestamps`
calls the whole network once per frame in a Python loop. Here the front runs on the frames of
many recordings at once, and the tail is one `nn.LSTM` over each recording's frames, with a row
per recording and its state carried from one window of frames to the next:

    recording 0  [f0 f1 ... f1023][f1024 ... f2047][f2048 ... f2200]
    recording 1  [f0 f1 ... f1023][f1024 ... f1500]
                  \_ one window: the front on every row's frames at once, then the LSTM over them

The probabilities equal the frame loop's (to float rounding), and silero's own
`get_speech_timestamps_from_probs` turns them into speech spans, so the spans are the package's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from encdec_engine.inputs.audio import SAMPLE_RATE
from encdec_engine.speech.vad_options import VadOptions

FRAME_SAMPLES = 512  # samples per Silero frame at 16 kHz (32 ms)
CONTEXT_SAMPLES = 64  # samples of the frame before, prepended to each frame
WINDOW_FRAMES = 1024  # frames per recording and step (33 s): the LSTM's state is carried between steps
MAX_STREAMS = 8  # recordings per step: at most 8 x 1024 frames through the front at once (~80 MB)
State = tuple[torch.Tensor, torch.Tensor]  # the LSTM's (h, c) after a row's last frame, each [1, 1, hidden]


def _load_silero():
    """The silero_vad module and its TorchScript model (shipped in the package: no download)."""
    threads = torch.get_num_threads()
    try:
        import silero_vad
    except ImportError as e:
        raise ImportError("vad_filter needs the silero-vad package: pip install silero-vad") from e
    finally:
        torch.set_num_threads(threads)  # importing silero_vad sets one thread for the whole process
    return silero_vad, silero_vad.load_silero_vad()


class SileroVad:
    """Silero VAD over many recordings at once: per-frame speech probabilities, and speech spans."""

    def __init__(self) -> None:
        module, jit = _load_silero()
        net = jit._model  # the 16 kHz network; its stateful wrapper (jit.forward) is not used
        self._front = lambda frames: net.encoder(net.run_extractors(frames))  # [n, 576] -> [n, 128, 1]
        cell = net.decoder.rnn
        hidden = cell.weight_hh.shape[1]
        self._lstm = torch.nn.LSTM(hidden, hidden, batch_first=True).eval()
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(self._lstm, f"{name}_l0").copy_(getattr(cell, name))
        self._head = net.decoder.decoder  # ReLU, 1x1 conv, sigmoid: [n, 128, 1] -> [n, 1, 1]
        self._spans_from_probs = module.get_speech_timestamps_from_probs

    @torch.inference_mode()
    def speech_probs(self, audios: Sequence[np.ndarray],
                     on_progress: Callable[[float, float], None] | None = None) -> list[np.ndarray]:
        """[num_frames] speech probability of every 32 ms frame of each [num_samples] 16 kHz recording
        (the last frame zero-padded), as silero's frame loop gives them. `on_progress(done, total)`:
        seconds of audio searched so far and in all, after each window of frames (the last: done == total)."""
        frames = [_frames(a) for a in audios]
        probs = [np.zeros(0, dtype=np.float32) for _ in audios]
        total = sum(len(a) for a in audios)  # samples
        done = 0
        order = sorted(range(len(audios)), key=lambda i: -len(frames[i]))  # longest first: live rows are a prefix
        for g in range(0, len(order), MAX_STREAMS):
            group = [i for i in order[g : g + MAX_STREAMS] if len(frames[i])]
            pieces: dict[int, list[torch.Tensor]] = {i: [] for i in group}
            states: list[State | None] = [None] * len(group)
            for start in range(0, len(frames[group[0]]) if group else 0, WINDOW_FRAMES):
                live = [i for i in group if len(frames[i]) > start]  # rows whose recording ended drop out
                rows, states = self.rows([frames[i][start : start + WINDOW_FRAMES] for i in live], states[: len(live)])
                for i, row in zip(live, rows):
                    pieces[i].append(row)
                    done += min((start + len(row)) * FRAME_SAMPLES, len(audios[i])) - start * FRAME_SAMPLES
                if on_progress is not None:
                    on_progress(done / SAMPLE_RATE, total / SAMPLE_RATE)
            for i in group:
                probs[i] = torch.cat(pieces[i]).numpy()
        return probs

    @torch.inference_mode()
    def rows(self, frames: Sequence[torch.Tensor], states: Sequence[State | None],
             ) -> tuple[list[torch.Tensor], list[State]]:
        """One call of the network over several rows of frames: the front on all of them at once, the LSTM
        over each row's frames from that row's state. `frames`: [n_i, CONTEXT_SAMPLES + FRAME_SAMPLES] per
        row (n_i >= 1); `states`: each row's LSTM state after its frames before (None: its first frames).
        Returns [n_i] probabilities per row and each row's state after its last frame."""
        lengths = [len(f) for f in frames]
        zeros = torch.zeros(1, 1, self._lstm.hidden_size)
        start = tuple(torch.cat([zeros if s is None else s[k] for s in states], dim=1) for k in range(2))
        front = self._front(torch.cat(list(frames))).squeeze(-1)  # [sum n_i, hidden]
        padded = torch.nn.utils.rnn.pad_sequence(front.split(lengths), batch_first=True)
        packed = torch.nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
        out, (h, c) = self._lstm(packed, start)
        hidden, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)  # [rows, max n_i, hidden]
        valid = torch.cat([hidden[row, :n] for row, n in enumerate(lengths)])
        probs = list(self._head(valid.unsqueeze(-1)).flatten().split(lengths))
        return probs, [(h[:, row : row + 1], c[:, row : row + 1]) for row in range(len(frames))]

    def speech_spans(self, audios: Sequence[np.ndarray], options: VadOptions,
                     on_progress: Callable[[float, float], None] | None = None) -> list[list[tuple[int, int]]]:
        """[(start, end)] sample spans of speech in each recording: silero's `get_speech_timestamps`
        with these options (`on_progress`: as `speech_probs`'s)."""
        spans = []
        for audio, probs in zip(audios, self.speech_probs(audios, on_progress)):
            found = self._spans_from_probs(
                probs.tolist(), sampling_rate=SAMPLE_RATE, threshold=options.threshold,
                neg_threshold=options.neg_threshold, min_speech_duration_ms=options.min_speech_duration_ms,
                max_speech_duration_s=options.max_speech_duration_s,
                min_silence_duration_ms=options.min_silence_duration_ms, speech_pad_ms=options.speech_pad_ms,
                audio_length_samples=len(audio))
            spans.append([(int(s["start"]), int(s["end"])) for s in found])
        return spans


@functools.lru_cache(maxsize=1)
def shared_vad() -> SileroVad:
    """The process's SileroVad, its model loaded on first use (the model holds no per-call state)."""
    return SileroVad()


def _frames(audio: np.ndarray) -> torch.Tensor:
    """[num_frames, CONTEXT_SAMPLES + FRAME_SAMPLES] frames of a [num_samples] recording, each after the
    last samples of the frame before (zeros before the first); a view of one padded copy."""
    num_frames = -(-len(audio) // FRAME_SAMPLES)
    if num_frames == 0:
        return torch.zeros(0, CONTEXT_SAMPLES + FRAME_SAMPLES)
    padded = torch.zeros(CONTEXT_SAMPLES + num_frames * FRAME_SAMPLES)
    padded[CONTEXT_SAMPLES : CONTEXT_SAMPLES + len(audio)] = torch.from_numpy(np.asarray(audio, dtype=np.float32))
    return padded.unfold(0, CONTEXT_SAMPLES + FRAME_SAMPLES, FRAME_SAMPLES)
