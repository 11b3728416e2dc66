"""The engine: requests in, one scheduler step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace

import torch

from encdec_engine.config import EngineConfig
from encdec_engine.engine.beam_search import BeamState
from encdec_engine.engine.block_manager import BlockManager, blocks_for
from encdec_engine.engine.loader import LoadedModel, load_model
from encdec_engine.engine.output_processor import OutputProcessor
from encdec_engine.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from encdec_engine.inputs.preprocess import InputProcessor, ProcessedInputs
from encdec_engine.inputs.prompts import PromptType
from encdec_engine.layers.sampling_state import RequestSampling
from encdec_engine.outputs import RequestOutput
from encdec_engine.probes import ProbeRequest, no_speech_position
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.sequence import SequenceStatus
from encdec_engine.engine.sequence_group import Sequence, SequenceGroup
from encdec_engine.worker.cache_engine import CacheEngine, bytes_per_block
from encdec_engine.worker.cuda_graphs import graph_batch_sizes
from encdec_engine.worker.kv_sizing import profile_forward, size_kv_pool, weight_bytes
from encdec_engine.worker.model_runner import ModelRunner
from encdec_engine.machine.cpu_kernels import fastest_dtype
from encdec_engine.machine.host_memory import keep_freed_memory
from encdec_engine.machine.threads import CoreShare, configure_threads, fits_threads, keep_threads

logger = logging.getLogger(__name__)
_GiB = 1 << 30


@dataclass(frozen=True)
class ProcessedRequest:
    """A request validated and prepared by `LLMEngine.process_request`, ready to be queued."""

    inputs: ProcessedInputs
    params: SamplingParams  # the engine's copy (bad words resolved to token ids)
    sampling: RequestSampling
    probes: ProbeRequest | None  # what its prefill reports besides samples


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.threads = configure_threads(config.threads)  # before any heavy work: loading packs weights too
        if config.dtype == "fastest":  # this machine's fastest floating type, calibrated at the thread count
            config = replace(config, dtype=fastest_dtype() if config.torch_device.type == "cpu" else "auto")
        self.config = config
        self.core_share: CoreShare | None = None  # the default count fitted to the cores others leave free
        if config.torch_device.type == "cpu":
            keep_freed_memory()  # big step tensors reuse freed memory instead of faulting in fresh pages
            if fits_threads(config.threads):
                self.core_share = CoreShare.here(self.threads)
        loaded: LoadedModel = load_model(config)
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        self.generation_config = loaded.generation_config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.eos_token_id = loaded.eos_token_id
        self.eos_token_ids = loaded.eos_token_ids
        self.max_decoder_len = min(config.max_model_len or loaded.max_decoder_len, loaded.max_decoder_len)

        spec, bs = self.model.kv_cache_spec, config.block_size
        self.kv_cache_dtype = config.torch_kv_cache_dtype  # int8: values + their scales (quantization/kv_int8.py)
        per_block = bytes_per_block(spec, bs, self.kv_cache_dtype)
        budget = config.max_num_batched_tokens or max(16384, loaded.max_encoder_len + self.max_decoder_len)
        self.kv_pool = size_kv_pool(
            spec, bs, self.kv_cache_dtype, self.device, num_kv_blocks=config.num_kv_blocks,
            kv_cache_space_gb=config.kv_cache_space_gb, gpu_memory_utilization=config.gpu_memory_utilization,
            run_profile_forward=lambda: profile_forward(self.model, loaded.backend, bs, self.device, budget,
                                                        config.max_num_seqs, self.max_decoder_len),
            cross_positions=(self.model.encoder_num_positions(loaded.max_encoder_len)
                             if self.model.is_encoder_decoder else None),
            model_bytes=weight_bytes(self.model))
        for line in self.kv_pool.describe().splitlines():  # a record each: every line gets the handler's prefix
            logger.info("%s", line)
        num_blocks = self.kv_pool.num_blocks
        num_swap = int(config.swap_space_gb * _GiB // per_block)
        self.block_manager = BlockManager(bs, num_blocks, num_swap, enable_caching=config.enable_prefix_caching)
        scheduling = SchedulerConfig(config.max_num_seqs, budget, chunked_prefill=config.enable_chunked_prefill,
                                     reserve_decode_growth=config.reserve_decode_growth)
        self.scheduler = Scheduler(scheduling, self.block_manager)
        self.cache_engine = CacheEngine(spec, bs, num_blocks, num_swap, self.kv_cache_dtype, self.device)
        self.runner = ModelRunner(self.model, loaded.backend, self.cache_engine, bs, self.device, config.seed)
        if hasattr(loaded.backend, "size_copies"):  # the CPU backend's head-major cross-context copies
            loaded.backend.size_copies(num_blocks * bytes_per_block(spec, bs, torch.float32))
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_decode_graphs(loaded)
        self.input_processor = InputProcessor(
            self.model, self.tokenizer, loaded.vocab_size, self.max_decoder_len, loaded.max_encoder_len,
            loaded.decoder_start_token_id, loaded.default_decoder_prompt, self.eos_token_id,
            loaded.decoder_prompt_starts, loaded.encoder_vocab_size,
        )
        self.groups: dict[str, SequenceGroup] = {}
        self._undelivered: list[RequestOutput] = []  # outputs of requests an interrupted step ended
        # OpenAI's rule, which the server turns on: a max_tokens past the model's length limit is an
        # error. Off (vLLM's offline behaviour), such a request ends at the limit with "length".
        self.reject_max_tokens_past_limit = False
        self._seq_ids = itertools.count()
        self.output_processor = OutputProcessor(self.block_manager, self.tokenizer, lambda: next(self._seq_ids))
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "generated_tokens": 0, "encoder_runs": 0,
                      "failed_steps": 0}

    def _capture_decode_graphs(self, loaded: LoadedModel) -> None:
        backend = loaded.backend
        if not backend.supports_cuda_graphs:
            logger.info("CUDA graphs off: the %s backend's decode cannot be captured", backend.name)
            return
        sizes = graph_batch_sizes(self.config.max_num_seqs)
        start = time.perf_counter()
        encoder_positions = (self.model.encoder_num_positions(loaded.max_encoder_len)
                             if self.model.is_encoder_decoder else None)
        try:
            used = self.runner.use_decode_graphs(sizes, self.max_decoder_len, encoder_positions)
        except Exception as e:
            raise RuntimeError(f"capturing decode in CUDA graphs failed ({type(e).__name__}: {e}); "
                               "enforce_eager=True (CLI --enforce-eager) runs decode without them") from e
        logger.info("CUDA graphs: decode captured at %d batch sizes (1..%d) in %.1f s, %.0f MiB; "
                    "larger batches run eagerly (enforce_eager=True turns graphs off)",
                    len(sizes), sizes[-1], time.perf_counter() - start, used / (1 << 20))

    # -- requests ------------------------------------------------------------
    def process_request(self, prompt: PromptType, params: SamplingParams | None = None) -> ProcessedRequest:
        """Validate and prepare a request: tokenize, compute audio features, resolve bad words, build its
        sampler state. Reads only what never changes after start-up, so any thread may call it (the async
        engine does, off its engine thread and the event loop). A bad request raises ValueError."""
        params = params or SamplingParams()
        if self.input_processor.num_mel_bins is not None:  # Whisper: HF generate's suppression by default
            params = params.with_checkpoint_suppression(self.generation_config)
        params.check_token_ids(self.input_processor.vocab_size)
        if params.bad_words:  # tokenized per request: the caller's params may serve other engines
            params = params.resolve_bad_words(self.tokenizer, self.input_processor.vocab_size)
        inputs = self.input_processor.process(prompt, params)
        self._check_fits(inputs.decoder_token_ids, inputs.encoder_seq, params)
        sampling = RequestSampling.build(params, self.eos_token_ids, self.input_processor.vocab_size, self.device)
        return ProcessedRequest(inputs, params, sampling, self._probes(inputs.decoder_token_ids, params))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request; a bad one raises ValueError and leaves the engine untouched."""
        self._check_request_id(request_id)
        self.add_processed(request_id, self.process_request(prompt, params), arrival_time)

    def add_processed(self, request_id: str, request: ProcessedRequest, arrival_time: float | None = None) -> None:
        """Queue a request prepared by `process_request`."""
        self._check_request_id(request_id)
        inputs, params = request.inputs, request.params
        # One sequence runs the prefill; n > 1 and beam search fork it afterwards, sharing its blocks.
        seqs = [Sequence(next(self._seq_ids), inputs.decoder_token_ids, inputs.decoder_prompt)]
        prompt_len = len(inputs.decoder_token_ids)
        max_len = min(prompt_len + (params.max_tokens or self.max_decoder_len), self.max_decoder_len)
        beam = None
        if params.use_beam_search:  # stop_token_ids end a beam as an EOS does (HF: a list of EOS ids)
            beam = BeamState(params.num_beams, params.length_penalty, params.early_stopping, prompt_len, max_len,
                             tuple(request.sampling.stop_token_ids))
        group = SequenceGroup(request_id, seqs, params, arrival_time or time.monotonic(), inputs.encoder_seq,
                              sampling=request.sampling, max_len=max_len, beam=beam, probes=request.probes)
        self.groups[request_id] = group
        self.scheduler.add(group)

    def _check_request_id(self, request_id: str) -> None:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _check_fits(self, decoder_ids: list[int], encoder_seq, params: SamplingParams) -> None:
        prompt_len = len(decoder_ids)
        if (self.reject_max_tokens_past_limit and params.max_tokens is not None
                and prompt_len + params.max_tokens > self.max_decoder_len):
            raise ValueError(f"max_tokens {params.max_tokens} plus the {prompt_len}-token decoder prompt is more "
                             f"than the model's limit of {self.max_decoder_len} positions; ask for at most "
                             f"{self.max_decoder_len - prompt_len}")
        if params.cross_attention_heads is not None:
            self._check_cross_attention_heads(params.cross_attention_heads, encoder_seq)
        fanout, max_seqs = max(params.best_of, params.num_beams), self.scheduler.config.max_num_seqs
        if fanout > max_seqs:
            raise ValueError(f"the request runs {fanout} sequences (best_of/num_beams) but max_num_seqs is {max_seqs}")
        bs, total = self.config.block_size, self.block_manager.num_total_device_blocks
        cross = blocks_for(encoder_seq.num_positions, bs) if encoder_seq is not None else 0
        # The prompt's blocks, plus one copied block per forked sequence.
        need = cross + blocks_for(len(decoder_ids) + 1, bs) + max(params.best_of, params.num_beams) - 1
        if need > total:
            raise ValueError(f"request needs {need} KV blocks ({cross} cross) but the pool has only {total}; "
                             "raise num_kv_blocks / kv_cache_space_gb or shorten the prompt")
        encoder = encoder_seq.num_positions if encoder_seq is not None else 0
        limit = self.scheduler.config.max_num_batched_tokens
        # Chunked, a prompt is computed across steps: the encoder and one decoder token must fit one,
        # the whole prompt only when its probes read all of it in one forward.
        whole = params.prompt_logprobs is not None or params.cross_attention_heads is not None
        positions = encoder + (1 if self.scheduler.config.chunked_prefill and not whole else prompt_len)
        if positions > limit:
            raise ValueError(f"prompt needs {positions} prefill positions in one step, more than "
                             f"max_num_batched_tokens={limit}")

    def _check_cross_attention_heads(self, pairs: list[tuple[int, int]], encoder_seq) -> None:
        if encoder_seq is None:
            raise ValueError("SamplingParams.cross_attention_heads needs an encoder-decoder model and prompt")
        spec = self.model.kv_cache_spec
        bad = [p for p in pairs if p[0] >= spec.num_layers or p[1] >= spec.num_kv_heads]
        if bad:
            raise ValueError(f"SamplingParams.cross_attention_heads {bad} are outside the decoder's "
                             f"{spec.num_layers} layers x {spec.num_kv_heads} heads")

    def _probes(self, decoder_ids: list[int], params: SamplingParams) -> ProbeRequest | None:
        """What the request's prefill reports besides samples; no_speech_prob is read right after the
        prompt's last decoder start token."""
        position = None
        if params.no_speech_token_id is not None:
            position = no_speech_position(decoder_ids, self.input_processor.decoder_start_token_id)
        heads = params.cross_attention_heads
        probes = ProbeRequest(params.no_speech_token_id, position, params.prompt_logprobs,
                              None if heads is None else tuple(tuple(pair) for pair in heads))
        return None if probes.empty else probes

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its self and cross blocks are freed at once."""
        group = self.scheduler.abort(request_id) or self.groups.get(request_id)
        if group is not None:
            # Also one an interrupted schedule() left outside every queue: free what it holds.
            for seq in group.unfinished_seqs():
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.block_manager.free_group(group)
        self.groups.pop(request_id, None)
        self._undelivered = [o for o in self._undelivered if o.request_id != request_id]
        self._release_if_idle()
        return self.output_processor.output(group) if group is not None else None

    def _release_if_idle(self) -> None:
        """With nothing left to run, the runner drops what it keeps between steps."""
        if not self.scheduler.has_unfinished():
            self.runner.release_idle()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._undelivered)

    # -- stepping ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step. A forward (or a swap or copy of KV blocks) that raises fails only
        this step's requests (finish_reason "error"); a failure while applying one request's result
        fails that request alone.

        Whatever ends a step early, KeyboardInterrupt and SystemExit included, un-registers the
        content hashes of the blocks the step allocated: a block never written is never found by a
        later request. Such an interrupt fails the step's requests too (their KV is incomplete) and
        propagates; their outputs come with the next step."""
        outputs, self._undelivered = self._undelivered, []
        if self.device.type == "cpu":  # the count fitted to the free cores, kept whatever else set it
            keep_threads(self.core_share.update() if self.core_share is not None else self.threads)
        # Hashes still pending belong to a step that never reached commit or rollback: never keep them.
        self.block_manager.rollback_step()
        try:
            metadata, out = self.scheduler.schedule()
        except BaseException:
            self.block_manager.rollback_step()
            raise
        outputs += [self._finish_ignored(g) for g in out.ignored]
        self.stats["prefill_steps"] += bool(out.prefills)
        self.stats["decode_steps"] += len(out.groups) > len(out.prefills)
        self.stats["encoder_runs"] += sum(1 for g in out.prefills if g.encoder_seq is not None
                                          and not g.encoder_cached and g.key not in out.continued)
        try:
            # Swap-ins were decided before this step's preemptions: their swap blocks may be handed
            # to a swap-out of the same step (and a group may go in and out again), so they go first.
            self.cache_engine.swap_in(out.blocks_to_swap_in)
            self.cache_engine.swap_out(out.blocks_to_swap_out)
            self.cache_engine.copy(out.blocks_to_copy)
            result = None if out.is_empty else self.runner.execute(metadata)
        except BaseException as e:
            # Nothing this step moved or computed can be trusted: the blocks it allocated were not (all)
            # written, so their hashes go before anyone can find them, and their requests end.
            self.block_manager.rollback_step()
            failed = self._fail_step(out, e)
            if not isinstance(e, Exception):  # an interrupt: the caller sees it; the outputs wait
                self._undelivered = failed
                raise
            outputs += failed
            self._release_if_idle()
            return outputs
        self.block_manager.commit_step()
        if out.is_empty:
            self._release_if_idle()
            return outputs
        self.output_processor.apply(out.groups, result, time.monotonic())
        self.stats["generated_tokens"] += sum(len(m.seq_data) for m in metadata if m.token_chunk_size is None)
        self.scheduler.free_finished()
        # A chunk of a prompt has nothing to tell its caller (unless it ended the request).
        outputs += [self._output(group) for group in out.groups
                    if group.key not in out.chunk_sizes or group.is_finished()]
        self._release_if_idle()
        return outputs

    def _fail_step(self, out: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """End every request whose KV the failed step touched, free its blocks; their outputs."""
        interrupted = not isinstance(error, Exception)  # the caller sees it: no error in the log
        logger.log(logging.DEBUG if interrupted else logging.ERROR, "a %s step of %d requests %s; they alone are ended",
                   "prefill" if out.is_prompt else "decode", len(out.groups),
                   "was interrupted" if interrupted else "failed", exc_info=not interrupted)
        self.stats["failed_steps"] += 1
        reason = "was interrupted" if interrupted else "failed"
        groups = list({id(g): g for g in out.groups + out.swapped_in + out.swapped_out}.values())
        for group in groups:
            self.output_processor.fail(group, f"the model step running this request {reason} "
                                              f"({type(error).__name__}: {error})", log=not interrupted)
            self.scheduler.remove(group)
        return [self._output(group) for group in groups]

    def _output(self, group: SequenceGroup) -> RequestOutput:
        if group.is_finished():
            group.finished_time = time.monotonic()
            self.groups.pop(group.request_id, None)
        return self.output_processor.output(group)

    def _finish_ignored(self, group: SequenceGroup) -> RequestOutput:
        logger.warning("request %s needs more KV blocks than the pool's %d (or more prefill positions than "
                       "max_num_batched_tokens); it ends with finish_reason 'length' after %d tokens",
                       group.request_id, self.block_manager.num_total_device_blocks,
                       max(len(s.output_token_ids) for s in group.seqs))
        if group.beam is not None:
            group.beam.cap([s.output_token_ids for s in group.seqs])
        group.finished_time = time.monotonic()
        self.groups.pop(group.request_id, None)
        return self.output_processor.output(group)

    # -- introspection -------------------------------------------------------
    def num_free_blocks(self) -> tuple[int, int]:
        """(free device blocks, free swap blocks)."""
        return self.block_manager.get_num_free_device_blocks(), self.block_manager.get_num_free_swap_blocks()

    def num_total_blocks(self) -> tuple[int, int]:
        return self.block_manager.num_total_device_blocks, self.block_manager.num_total_swap_blocks

    def compute_description(self) -> str:
        """The model's compute type in words: its dtype, and where int8 weights run."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.config.bf16_encoder_int8_decoder:
            return "bfloat16 encoder, int8 decoder"
        return f"{dtype}, int8 weights" if self.config.quantization == "int8" else dtype

    def describe(self) -> str:
        """What runs where, for start-up logs: model, architecture, device, dtype, CPU threads, KV blocks."""
        return (f"model {self.config.model} ({type(self.model).__name__}) on {self.device}, "
                f"{self.compute_description()}, {self.threads} CPU threads, "
                f"KV pool of {self.kv_pool.num_blocks} blocks x {self.config.block_size} tokens")
