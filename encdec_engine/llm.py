"""The offline Python API: `LLM.generate`, `LLM.summarize` and `LLM.transcribe`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from encdec_engine.config import EngineConfig
from encdec_engine.engine.llm_engine import LLMEngine
from encdec_engine.inputs.prompts import PromptType
from encdec_engine.outputs import RequestOutput
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.speech.offline import transcribe_offline
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Transcription


class LLM:
    """Load a checkpoint once, then run batches of requests through the engine.

    >>> llm = LLM(model="path/to/bart")
    >>> outs = llm.generate(["A long document ..."], SamplingParams(temperature=0.0, max_tokens=64))
    >>> outs[0].outputs[0].text
    """

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        All prompts are validated before any runs: a bad one raises ValueError
        naming its index, and the engine stays ready for the next call. A request
        that fails while it runs (its logits processor raised, the step running it
        failed) comes back with finish_reason "error" and `error` set; the others
        still finish.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"{next(self._request_ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
                try:
                    engine.add_request(rid, prompt, p)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from e
                added.append(rid)
        except ValueError:
            for rid in added:
                engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id not in finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in finished:
                    engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in ids]

    def transcribe(self, audio, language: str | None = None, task: str = "transcribe", use_tqdm: bool = False,
                   max_in_flight: int | None = None, **options) -> list[Transcription]:
        """Transcribe audio files (any format librosa reads), arrays at 16 kHz, or (samples, sample_rate)
        pairs. Returns one Transcription per input in input order; an input that cannot be read gets
        `error` set while the others are still transcribed. `options` are TranscribeOptions fields."""
        return transcribe_offline(self.engine, TranscribeOptions(language=language, task=task, **options), audio,
                                  use_tqdm=use_tqdm, max_in_flight=max_in_flight)

    def summarize(self, texts: str | Sequence[str], use_tqdm: bool = False, **overrides) -> list[str]:
        """Summaries exactly as HF `generate` makes them with the checkpoint's generation config
        (beam search, length penalty, max/min length, no-repeat n-grams, forced BOS/EOS);
        `overrides` replace SamplingParams fields."""
        if isinstance(texts, str):
            texts = [texts]
        params = summarization_params(self.engine, **overrides)
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("summarize needs a tokenizer (skip_tokenizer_init=True was set)")
        limit = self.engine.input_processor.max_encoder_len
        start = [self.engine.input_processor.decoder_start_token_id]
        prompts = [{"encoder_prompt": {"prompt_token_ids": tok(t, truncation=True, max_length=limit)["input_ids"]},
                    "decoder_prompt": {"prompt_token_ids": start}} for t in texts]
        for i, t in enumerate(texts):
            if not t.strip():
                raise ValueError(f"text {i} is empty")
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        failed = [f"text {i}: {o.error}" for i, o in enumerate(outs) if o.error is not None]
        if failed:
            raise RuntimeError(f"summarizing failed for {'; '.join(failed)}")
        return [o.outputs[0].text.strip() for o in outs]


def summarization_params(engine: LLMEngine, **overrides) -> SamplingParams:
    """Map the checkpoint's HF generation config onto SamplingParams.

    Summaries start, as in HF, from the decoder start token alone, with BOS and
    EOS forced by processors; HF's max_length/min_length count that start token.
    """
    gc = engine.generation_config
    # HF: max/min_new_tokens win; else max/min_length count the start token; else 20 new tokens.
    max_new = getattr(gc, "max_new_tokens", None) or max(1, (getattr(gc, "max_length", None) or 21) - 1)
    min_new = getattr(gc, "min_new_tokens", None) or max(0, (getattr(gc, "min_length", None) or 0) - 1)
    fields = dict(
        temperature=0.0,
        max_tokens=max_new,
        min_tokens=min(min_new, max_new),
        no_repeat_ngram_size=getattr(gc, "no_repeat_ngram_size", 0) or 0,
        repetition_penalty=getattr(gc, "repetition_penalty", 1.0) or 1.0,
        forced_bos_token_id=getattr(gc, "forced_bos_token_id", None),
        forced_eos_token_id=getattr(gc, "forced_eos_token_id", None),
        num_beams=getattr(gc, "num_beams", 1) or 1,
        length_penalty=_or_default(getattr(gc, "length_penalty", None), 1.0),
        early_stopping=_or_default(getattr(gc, "early_stopping", None), False),
    )
    fields.update(overrides)
    return SamplingParams(**fields)


def _or_default(value, default):
    return default if value is None else value
