"""openai-whisper's decoding defaults, for Whisper checkpoints whose generation config lacks them.

HF's Whisper generation configs carry them as `suppress_tokens`, `begin_suppress_tokens` and
`max_initial_timestamp_index`; openai-whisper computes them from the tokenizer:

- `suppress_tokens` ("-1" in `DecodingOptions`): the tokens of symbols that are not speech
  (`tokenizer.non_speech_tokens`) plus <|transcribe|>, <|translate|>, <|startoftranscript|>,
  <|startofprev|>, <|startoflm|> and <|nospeech|>;
- `begin_suppress_tokens` (`suppress_blank`): " " and <|endoftext|> at the first position;
- `max_initial_timestamp_index`: 1.0 s, i.e. 50 steps of 0.02 s.
"""

from __future__ import annotations

MAX_INITIAL_TIMESTAMP_INDEX = 50  # openai-whisper's max_initial_timestamp 1.0 s in 0.02 s steps
# openai-whisper's non-speech symbols; the single-token ones are suppressed, and the musical
# notes (U+2640..U+267F) always, by their first token.
_SYMBOLS = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』') + (
    "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split())
_MUSIC = list("♩♪♫♬♭♮♯")


def non_speech_tokens(tokenizer) -> set[int]:
    """openai-whisper's `Tokenizer.non_speech_tokens`, through an HF tokenizer of the same vocabulary."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    result = {encode(" -")[0], encode(" '")[0]}
    for symbol in _SYMBOLS + _MUSIC:
        for tokens in (encode(symbol), encode(" " + symbol)):
            if len(tokens) == 1 or symbol in _MUSIC:
                result.add(tokens[0])
    return result


def suppress_tokens(tokenizer, special_ids: list[int]) -> list[int]:
    """openai-whisper's default suppress_tokens: non-speech tokens plus the task and special tokens."""
    return sorted(non_speech_tokens(tokenizer) | set(special_ids))


def begin_suppress_tokens(tokenizer, eot: int) -> list[int]:
    """openai-whisper's `suppress_blank`: no blank and no <|endoftext|> as the first token."""
    return [*tokenizer.encode(" ", add_special_tokens=False), eot]
