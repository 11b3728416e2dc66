"""Word-level timestamps from Whisper's cross-attention (openai-whisper's method, as faster-whisper uses it).

After a window is decoded, its text is run once more through the decoder,
teacher-forced as `<|startoftranscript|> ... <|notimestamps|> text <|endoftext|>`
(the engine's `cross_attention_heads` + `prompt_logprobs` request, which reuses
the window's cached encoder output). The alignment heads' attention over the
audio frames, normalized per frame and median-filtered, is averaged into a
token x frame matrix; dynamic time warping finds the monotonic path through
it, and each word starts where the path enters its first token. Then the
heuristics of openai-whisper's `add_word_timestamps`: words at sentence ends
and after pauses are capped at twice the median word duration, punctuation
joins its neighbour, and each segment's start and end move to its words.

Word probability is the mean probability of the word's tokens in that
teacher-forced pass, over the text tokens only (as openai-whisper and
CTranslate2 compute it).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from encdec_engine.speech.options import APPEND_PUNCTUATIONS, PREPEND_PUNCTUATIONS
from encdec_engine.speech.results import Segment, Word

TOKENS_PER_SECOND = 50  # encoder positions per second of audio
MEDIAN_FILTER_WIDTH = 7
_UNICODE_SPLIT_LANGUAGES = {"zh", "ja", "th", "lo", "my", "yue"}  # no spaces between words


@dataclass
class WordTiming:
    word: str
    tokens: list[int]
    start: float  # seconds from the window start
    end: float
    probability: float


def alignment_heads(generation_config, num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """The checkpoint's alignment heads; without them, openai-whisper's default: every head of
    the upper half of the decoder layers."""
    heads = getattr(generation_config, "alignment_heads", None)
    if heads:
        return [(int(layer), int(head)) for layer, head in heads]
    return [(layer, head) for layer in range(num_layers // 2, num_layers) for head in range(num_heads)]


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of the last dimension, reflect-padded (openai-whisper's filter)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    shape = x.shape
    padded = F.pad(x.reshape(-1, 1, shape[-1]), (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad].reshape(shape)


def dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost monotonic path through x [N, M] from (0, 0) to (N-1, M-1): (text indices, time
    indices). Same float32 costs and tie rule as openai-whisper's loop (diagonal, then up, else left),
    computed one anti-diagonal at a time, whose cells depend only on the two diagonals before."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    cost[0, 0] = 0.0
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        cost[i, j] = x[i - 1, j - 1] + np.choose(t, (c0, c1, c2))
        trace[i, j] = t
    trace[0, :], trace[:, 0] = 2, 1
    i, j = n, m
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    path = np.array(path[::-1])
    return path[:, 0], path[:, 1]


def split_to_word_tokens(tokenizer, tokens: list[int], eot: int, language: str | None) -> tuple[list, list]:
    """Words and their tokens: split where a token starts with a space or is punctuation
    (languages written without spaces: at every complete unicode character)."""
    pieces, piece_tokens = _split_on_unicode(tokenizer, tokens)
    if language in _UNICODE_SPLIT_LANGUAGES:
        return pieces, piece_tokens
    words, word_tokens = [], []
    for piece, ids in zip(pieces, piece_tokens):
        if ids[0] >= eot or piece.startswith(" ") or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(list(ids))
        else:
            words[-1] += piece
            word_tokens[-1].extend(ids)
    return words, word_tokens


def _split_on_unicode(tokenizer, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    full = decode(tokens)
    pieces, piece_tokens, current, offset = [], [], [], 0
    for token in tokens:
        current.append(token)
        text = decode(current)
        bad = text.find("\ufffd")  # an incomplete multi-byte character, unless the text really has one
        if bad < 0 or full[offset + bad : offset + bad + 1] == "\ufffd":
            pieces.append(text)
            piece_tokens.append(current)
            current, offset = [], offset + len(text)
    return pieces, piece_tokens


def alignment_path(cross_attentions: torch.Tensor, prefix_len: int, num_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """The DTW path (text indices, time indices) through the alignment heads' attention: rows are the
    text tokens + EOT, columns the encoder positions of the audio (num_frames mel frames)."""
    weights = cross_attentions[:, :, : num_frames // 2].float()
    weights = weights / weights.sum(dim=-1, keepdim=True)  # softmax over the audio's frames only
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = median_filter((weights - mean) / std, MEDIAN_FILTER_WIDTH)
    matrix = weights.mean(dim=0)[prefix_len - 1 : -1]  # the rows that predict the text tokens and EOT
    return dtw(-matrix.double().numpy())


def find_alignment(cross_attentions: torch.Tensor, token_probs: list[float], text_tokens: list[int],
                   prefix_len: int, num_frames: int, tokenizer, eot: int,
                   language: str | None) -> list[WordTiming]:
    """cross_attentions: [heads, prefix_len + len(text_tokens) + 1, encoder positions] of the teacher-forced
    pass over prefix (ending in <|notimestamps|>) + text + EOT; token_probs: each text token's probability."""
    if not text_tokens:
        return []
    text_indices, time_indices = alignment_path(cross_attentions, prefix_len, num_frames)
    words, word_tokens = split_to_word_tokens(tokenizer, text_tokens + [eot], eot, language)
    if len(word_tokens) <= 1:
        return []
    boundaries = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = time_indices[jumps] / TOKENS_PER_SECOND
    starts, ends = jump_times[boundaries[:-1]], jump_times[boundaries[1:]]
    probs = [float(np.mean(token_probs[i:j])) for i, j in zip(boundaries[:-1], boundaries[1:])]
    return [WordTiming(w, t, float(s), float(e), p)
            for w, t, s, e, p in zip(words, word_tokens, starts, ends, probs)]


def merge_punctuations(alignment: list[WordTiming], prepended: str, appended: str) -> None:
    """Opening punctuation joins the next word, closing punctuation the previous one (in place;
    the emptied entries keep their place with no text and no tokens)."""
    i, j = len(alignment) - 2, len(alignment) - 1
    while i >= 0:
        previous, following = alignment[i], alignment[j]
        if previous.word.startswith(" ") and previous.word.strip() in prepended:
            following.word, following.tokens = previous.word + following.word, previous.tokens + following.tokens
            previous.word, previous.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        previous, following = alignment[i], alignment[j]
        if not previous.word.endswith(" ") and following.word in appended:
            previous.word, previous.tokens = previous.word + following.word, previous.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1


def add_word_timestamps(segments: list[Segment], alignment: list[WordTiming], eot: int, time_offset: float,
                        last_speech: float, prepend_punctuations: str = PREPEND_PUNCTUATIONS,
                        append_punctuations: str = APPEND_PUNCTUATIONS) -> None:
    """Give the window's segments their words (in place) and move each segment's start and end to
    its words, with openai-whisper's duration heuristics. `last_speech`: where speech last ended
    before this window (seconds); the punctuation marks join the next / the previous word."""
    durations = np.array([w.end - w.start for w in alignment])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    if len(durations):  # words at sentence boundaries are at most twice the median duration
        for i in range(1, len(alignment)):
            if alignment[i].end - alignment[i].start > longest:
                if alignment[i].word in ".。!！?？":
                    alignment[i].end = alignment[i].start + longest
                elif alignment[i - 1].word in ".。!！?？":
                    alignment[i].start = alignment[i].end - longest
    merge_punctuations(alignment, prepend_punctuations, append_punctuations)

    index = 0
    for segment in segments:
        text_count = sum(1 for t in segment.tokens if t < eot)
        words, saved = [], 0
        while index < len(alignment) and saved < text_count:
            timing = alignment[index]
            if timing.word:
                words.append(Word(round(time_offset + timing.start, 2), round(time_offset + timing.end, 2),
                                  timing.word, timing.probability))
            saved += len(timing.tokens)
            index += 1
        if words:
            _fix_edges(segment, words, median, longest, last_speech)
            last_speech = segment.end
        segment.words = words


def _fix_edges(segment: Segment, words: list[Word], median: float, longest: float, last_speech: float) -> None:
    # The first (and second) word after a pause are at most twice the median duration.
    if words[0].end - last_speech > median * 4 and (
            words[0].end - words[0].start > longest
            or (len(words) > 1 and words[1].end - words[0].start > longest * 2)):
        if len(words) > 1 and words[1].end - words[1].start > longest:
            boundary = max(words[1].end / 2, words[1].end - longest)
            words[0].end = words[1].start = boundary
        words[0].start = max(0, words[0].end - longest)
    # Prefer the segment's timestamps where the first or last word came out too long.
    if segment.start < words[0].end and segment.start - 0.5 > words[0].start:
        words[0].start = max(0, min(words[0].end - median, segment.start))
    else:
        segment.start = words[0].start
    if segment.end > words[-1].start and segment.end + 0.5 < words[-1].end:
        words[-1].end = max(words[-1].start + median, segment.end)
    else:
        segment.end = words[-1].end


def last_word_end(segments: list[Segment]) -> float | None:
    """The end of the segments' last word (seconds); None when they have no words."""
    return next((w.end for s in reversed(segments) for w in reversed(s.words or ())), None)


def speech_end(segments: list[Segment]) -> float | None:
    """The last word's end, else the last segment's end (openai-whisper's get_end)."""
    end = last_word_end(segments)
    return end if end is not None or not segments else segments[-1].end
