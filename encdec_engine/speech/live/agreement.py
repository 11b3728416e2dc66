"""LocalAgreement (Macháček et al., 2023, "Turning Whisper into Real-Time Transcription System"; the
whisper_streaming policy): the buffer of a live turn is decoded again and again as it grows, and a word
is confirmed once the last n hypotheses all have it next after the words confirmed before. Confirmed
text is never taken back.

    confirmed          " Today is"
    hypothesis 1       " Today is| a| beaut"                    after the confirmed words: [" a"], [" beaut"]
    hypothesis 2       " Today is| a| beautiful| day| to"       [" a"], [" beautiful"], [" day"], [" to"]
                                   ^ agreed: " a" is confirmed; " beaut" != " beautiful" ends the run

One refinement: the newest hypothesis's last word is not confirmed until a word follows it, since the
end of the audio may have cut it in half (" jump" for " jumps") in every hypothesis alike.

A word is a run of text tokens that starts with a token beginning with a space (or with the first text
token after a timestamp) and takes the text tokens after it, punctuation included; a timestamp token
ends the word before it and belongs to none. Words agree when their token ids do. Where a hypothesis no
longer starts with the confirmed words (one of them was wrong), `align` finds where they end in it, by
their letters, so that agreement goes on from there.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Word:
    tokens: tuple[int, ...]  # its text tokens
    text: str  # its text, the leading space included

    @property
    def key(self) -> str:
        """The word's letters and digits, lower-case (how words are matched in `align`)."""
        return re.sub(r"\W", "", self.text.lower())


class Hypothesis:
    """One decode of a buffer: its tokens (text and timestamps, <|endoftext|> left out), cut into words,
    and where its segments end."""

    def __init__(self, tokens: Sequence[int], is_text: Callable[[int], bool], starts_word: Callable[[int], bool],
                 decode: Callable[[list[int]], str]) -> None:
        self.tokens = list(tokens)
        self.spans = word_spans(self.tokens, is_text, starts_word)
        self.words = [Word(tuple(self.tokens[a:b]), decode(self.tokens[a:b])) for a, b in self.spans]
        # (index of a timestamp token closing a segment, the number of words before it)
        self.segment_ends = [(i, sum(1 for _, b in self.spans if b <= i)) for i in range(1, len(self.tokens))
                             if not is_text(self.tokens[i]) and is_text(self.tokens[i - 1])]


def word_spans(tokens: Sequence[int], is_text: Callable[[int], bool],
               starts_word: Callable[[int], bool]) -> list[tuple[int, int]]:
    """[start, end) token spans of the words of `tokens`, in order."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate(tokens):
        if not is_text(token):
            if start is not None:
                spans.append((start, i))
            start = None
        elif start is None or starts_word(token):
            if start is not None:
                spans.append((start, i))
            start = i
    if start is not None:
        spans.append((start, len(tokens)))
    return spans


def agreed_words(hypotheses: Sequence[Sequence[Hashable]]) -> int:
    """How many leading words all the hypotheses share (each a sequence of comparable words)."""
    if not hypotheses:
        return 0
    count = 0
    for words in zip(*hypotheses):
        if any(word != words[0] for word in words[1:]):
            break
        count += 1
    return count


def align(words: Sequence[Word], confirmed: Sequence[Word]) -> int:
    """Where the confirmed words end in a hypothesis's words: len(confirmed) when it starts with them;
    else after the last confirmed word found in it (by letters), the confirmed words after that taken
    as substitutes for as many words of the hypothesis."""
    if [w.tokens for w in words[: len(confirmed)]] == [w.tokens for w in confirmed]:
        return len(confirmed)
    matcher = difflib.SequenceMatcher(None, [w.key for w in confirmed], [w.key for w in words], autojunk=False)
    blocks = [b for b in matcher.get_matching_blocks() if b.size]
    if not blocks:
        return min(len(confirmed), len(words))
    last = blocks[-1]
    matched_end = last.b + last.size  # after the last confirmed word found
    unmatched = len(confirmed) - (last.a + last.size)  # confirmed words after it
    return min(len(words), matched_end + unmatched)
