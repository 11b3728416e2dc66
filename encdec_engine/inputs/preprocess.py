"""From a prompt of any format to validated decoder tokens and an encoder sequence.

Encoder/decoder models: the singleton (or explicit encoder) prompt feeds the
encoder; the decoder gets the model's default decoder prompt (BART:
`[decoder_start, bos]`) unless an explicit decoder prompt is given, which is
then prefixed with the decoder start token unless already first. A text
decoder prompt is tokenized with the tokenizer's special tokens minus a
trailing EOS, since the decoder continues it.

Decoder-only models: the singleton prompt is the decoder prompt, and an
explicit encoder/decoder prompt is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encdec_engine.inputs.audio import HOP_LENGTH, N_FFT, N_FRAMES, N_SAMPLES, SAMPLE_RATE, audio_samples
from encdec_engine.inputs.features import log_mel_spectrogram
from encdec_engine.inputs.prompts import ParsedSingleton, PromptType, check_unicode, parse_prompt
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.sequence import EncoderSequence


@dataclass
class ProcessedInputs:
    decoder_token_ids: list[int]
    decoder_prompt: str | None
    encoder_seq: EncoderSequence | None


class InputProcessor:
    def __init__(self, model, tokenizer, vocab_size: int, max_decoder_len: int, max_encoder_len: int,
                 decoder_start_token_id: int | None, default_decoder_prompt: list[int] | None,
                 eos_token_id: int | None, decoder_prompt_starts: tuple[int, ...] = (),
                 encoder_vocab_size: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the decoder's (its head's): what decoder prompts and outputs draw from
        self.encoder_vocab_size = encoder_vocab_size or vocab_size  # Marian may have two vocabularies
        self.max_decoder_len = max_decoder_len
        self.max_encoder_len = max_encoder_len
        self.decoder_start_token_id = decoder_start_token_id
        self.default_decoder_prompt = default_decoder_prompt
        self.eos_token_id = eos_token_id
        # Tokens that may open a decoder prompt besides the decoder start (Whisper's <|startofprev|>).
        self.decoder_prompt_starts = {decoder_start_token_id, *decoder_prompt_starts}

    @property
    def is_encoder_decoder(self) -> bool:
        return self.model.is_encoder_decoder

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedInputs:
        parsed = parse_prompt(prompt)
        if not self.is_encoder_decoder:
            if parsed.explicit:
                raise ValueError("explicit encoder/decoder prompts need an encoder/decoder model; "
                                 "this model is decoder-only, pass a single prompt")
            ids = self._tokens(parsed.primary, "prompt", add_special_tokens=True, drop_eos=False)
            ids = self._truncate(ids, params, "prompt", self.max_decoder_len - 1)  # room for one token
            self._check_decoder(ids, "prompt")
            return ProcessedInputs(ids, parsed.primary.text, None)

        encoder_seq = self.encoder_sequence(parsed.primary, params)
        if parsed.decoder is None:
            ids, text = list(self.default_decoder_prompt or []), None
        else:
            ids = self._tokens(parsed.decoder, "decoder_prompt", add_special_tokens=True, drop_eos=True)
            text = parsed.decoder.text
        start = self.decoder_start_token_id
        if start is not None and (not ids or ids[0] not in self.decoder_prompt_starts):
            ids = [start] + ids
        self._check_decoder(ids, "decoder_prompt")
        return ProcessedInputs(ids, text, encoder_seq)

    @property
    def num_mel_bins(self) -> int | None:
        """Set for audio models (Whisper): their encoder input is a log-mel window."""
        return getattr(self.model, "num_mel_bins", None)

    def encoder_sequence(self, prompt: ParsedSingleton, params: SamplingParams) -> EncoderSequence:
        if self.num_mel_bins is not None:
            return self._audio_encoder_sequence(prompt)
        if prompt.multi_modal_data:
            raise ValueError(f"this model takes text only, got multi_modal_data {sorted(prompt.multi_modal_data)}")
        if prompt.mm_processor_kwargs:
            raise ValueError("this model takes text only, got mm_processor_kwargs "
                             f"{sorted(prompt.mm_processor_kwargs)}")
        ids = self._tokens(prompt, "encoder prompt", add_special_tokens=True, drop_eos=False,
                           vocab_size=self.encoder_vocab_size)
        ids = self._truncate(ids, params, "encoder prompt", self.max_encoder_len)
        return EncoderSequence(num_positions=self.model.encoder_num_positions(len(ids)), prompt_token_ids=ids,
                               prompt=prompt.text, cache_key=content_key(ids))

    def _audio_encoder_sequence(self, prompt: ParsedSingleton) -> EncoderSequence:
        mm = prompt.multi_modal_data or {}
        if prompt.text or prompt.token_ids:
            raise ValueError("the encoder prompt of an audio model is its audio: pass "
                             "{'prompt': '', 'multi_modal_data': {'audio': (samples, sample_rate)}} and put any "
                             "text in the decoder prompt")
        positions = self._audio_ctx(prompt.mm_processor_kwargs or {})
        frames = 2 * positions  # the encoder reads the window's first frames (all 3000 unless audio_ctx says)
        if "input_features" in mm:
            features = torch.as_tensor(mm["input_features"], dtype=torch.float32)
            if tuple(features.shape) != (self.num_mel_bins, N_FRAMES):
                raise ValueError(f"input_features must have shape ({self.num_mel_bins}, {N_FRAMES}), "
                                 f"got {tuple(features.shape)}")
            features = features[:, :frames]
        elif "audio" in mm:
            samples = audio_samples(mm["audio"])
            if len(samples) > N_SAMPLES:
                raise ValueError(f"audio is {len(samples) / SAMPLE_RATE:.1f} s long; one request holds at most "
                                 f"{N_SAMPLES // SAMPLE_RATE} s (use LLM.transcribe for long-form audio)")
            features = log_mel_spectrogram([samples], n_mels=self.num_mel_bins, pad_to=_mel_span(len(samples), frames))
            features = features[0, :, :frames]
        else:
            raise ValueError("an audio model needs multi_modal_data={'audio': (samples, sample_rate)}")
        return EncoderSequence(num_positions=positions, features=features, cache_key=content_key(features))

    def _audio_ctx(self, kwargs: dict) -> int:
        """`mm_processor_kwargs={"audio_ctx": n}`: the encoder reads the window's first n positions (2n mel
        frames, 20 ms each) instead of all 1500, as whisper.cpp's `audio_ctx`. The attention then sees no
        padding past them: a decode of a few seconds of audio costs what those seconds cost, and its text
        may differ from the full window's (live transcription's interim decodes use it, never the final).
        Without it, the whole window's positions."""
        unknown = sorted(set(kwargs) - {"audio_ctx"})
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unknown keys {unknown}; an audio model takes 'audio_ctx'")
        full = self.model.encoder_num_positions(N_FRAMES)
        n = kwargs.get("audio_ctx")
        n = full if n is None else n
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= full:
            raise ValueError(f"mm_processor_kwargs: audio_ctx must be an int of encoder positions in [1, {full}] "
                             f"(20 ms each; {full} is the whole 30 s window), got {n!r}")
        return n

    # -- helpers -------------------------------------------------------------
    def _tokens(self, prompt: ParsedSingleton, what: str, add_special_tokens: bool, drop_eos: bool,
                vocab_size: int | None = None) -> list[int]:
        vocab_size = vocab_size or self.vocab_size
        if prompt.kind == "tokens":
            ids = list(prompt.token_ids)
        else:
            if prompt.text == "" or prompt.text is None:
                raise ValueError(f"{what} is empty")
            if self.tokenizer is None:
                raise ValueError(f"{what}: text prompts need a tokenizer (skip_tokenizer_init=True was set); "
                                 "pass prompt_token_ids instead")
            check_unicode(prompt.text, what)
            ids = self.tokenizer(prompt.text, add_special_tokens=add_special_tokens)["input_ids"]
            if drop_eos and len(ids) > 1 and ids[-1] == self.eos_token_id:
                ids = ids[:-1]
        if not ids:
            raise ValueError(f"{what} is empty")
        bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{what}: token id {bad[1]} at index {bad[0]} is outside the vocabulary "
                             f"[0, {vocab_size})")
        return ids

    @staticmethod
    def _truncate(ids: list[int], params: SamplingParams, what: str, limit: int) -> list[int]:
        if params.truncate_prompt_tokens is not None:
            ids = ids[-min(params.truncate_prompt_tokens, limit):]
        if len(ids) > limit:
            raise ValueError(f"{what} has {len(ids)} tokens, more than the model's limit of {limit}; "
                             f"shorten it or set truncate_prompt_tokens={limit} to keep its last {limit}")
        return ids

    def _check_decoder(self, ids: list[int], what: str) -> None:
        if len(ids) >= self.max_decoder_len:
            raise ValueError(f"{what} has {len(ids)} tokens, leaving no room to generate within the decoder's "
                             f"limit of {self.max_decoder_len} positions")


def _mel_span(num_samples: int, frames: int) -> int:
    """Samples to compute a window's first `frames` log-mel frames from: all the audio (the dynamic range is
    clamped below its peak) and the frames' own reach (an STFT frame reads N_FFT / 2 samples past its hop),
    zeros after the audio as in the 30 s window. Its first `frames` frames then equal the whole window's."""
    if frames == N_FRAMES:
        return N_SAMPLES
    span = max(num_samples, frames * HOP_LENGTH) + N_FFT
    return min(N_SAMPLES, -(-span // HOP_LENGTH) * HOP_LENGTH)


def content_key(encoder_input) -> bytes:
    """A digest identifying an encoder input (token ids or a feature tensor) for output reuse."""
    import hashlib

    import numpy as np

    if isinstance(encoder_input, list):
        data = np.asarray(encoder_input, dtype=np.int64).tobytes()
    else:
        data = repr(tuple(encoder_input.shape)).encode() + encoder_input.detach().cpu().contiguous().numpy().tobytes()
    return hashlib.sha256(data).digest()
