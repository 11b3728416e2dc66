"""Turns scheduled groups into flat model inputs, runs the model and samples.

Prefill and decode inputs are built by two functions. Both flatten the
decoder sequences of the step in scheduling order, derive the token-level
arrays with `prepare_token_arrays`, and describe each attention type with
one `AttentionView`:

- prefill: encoder (non-causal, block-diagonal over encoder lengths),
  decoder self (causal, block-diagonal over decoder lengths; reads the cache
  only where a prefix is already cached), cross (non-causal, rectangular
  decoder x encoder blocks; writes the cross cache from the encoder output);
- decode: decoder self and cross read their paged caches through block tables;
  on CUDA, batches up to the largest captured size replay a CUDA graph
  (`cuda_graphs.DecodeGraphs`) over the same arrays (`DecodeBatch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from encdec_engine.attention.capture import CaptureRequest, CrossCapture
from encdec_engine.attention.metadata import AttentionMetadata, AttentionView, host_to_device
from encdec_engine.worker.step_input import SequenceGroupMetadata
from encdec_engine.layers.logits_processors import SamplingRow
from encdec_engine.layers.sampler import Sampler, beam_log_probs
from encdec_engine.models.interface import EncoderInputs, stack_features
from encdec_engine.probes import ProbeResults
from encdec_engine.worker.cache_engine import CacheEngine
from encdec_engine.worker.cuda_graphs import MAX_GRAPH_CONTEXT, DecodeGraphs
from encdec_engine.worker.input_prep import DecodeBatch, TokenArrays, pad_rows, prepare_token_arrays
from encdec_engine.worker.step_output import RowOutput, StepOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    # [num_seqs + num_probes] the token whose logits sample each sequence, then each no-speech probe's token
    logits_indices: torch.Tensor
    encoder_inputs: EncoderInputs | None = None
    no_speech_rows: list[int] = field(default_factory=list)  # rows whose prefill reports no_speech_prob
    # (row, prompt positions) of rows reporting prompt logprobs; their logits follow the no-speech probes'
    prompt_logprob_rows: list[tuple[int, int]] = field(default_factory=list)
    captures: list[tuple[int, CaptureRequest]] = field(default_factory=list)  # (row, its cross-attention capture)


@dataclass
class StepRow:
    """One sampled decoder sequence of a step."""

    group: SequenceGroupMetadata
    seq_id: int
    group_index: int  # the group's index in the step's metadata list


class ModelRunner:
    def __init__(
        self, model, backend, cache_engine: CacheEngine, block_size: int, device: torch.device, seed: int = 0,
    ) -> None:
        self.model = model
        self.backend = backend
        self.cache = cache_engine
        if getattr(backend, "blocks_written", None) is not None:
            cache_engine.write_listeners.append(backend.blocks_written)
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.graphs: DecodeGraphs | None = None  # decode from CUDA graphs (see use_decode_graphs)
        self.graph_steps = 0

    def use_decode_graphs(self, batch_sizes: list[int], max_decoder_len: int, max_encoder_positions: int | None,
                          capture: bool = True) -> int:
        """Run decode batches of up to max(batch_sizes) sequences through static, padded buffers,
        captured as CUDA graphs (larger batches stay eager). Returns the device memory the
        capture took. `capture=False` runs the same padded batches eagerly (the CPU tests)."""
        def blocks(positions: int) -> int:
            return -(-min(positions, MAX_GRAPH_CONTEXT) // self.block_size)

        graphs = DecodeGraphs(
            self.model, self.backend, self.cache.kv_caches, self.block_size, batch_sizes,
            max_blocks=blocks(max_decoder_len),
            max_cross_blocks=None if max_encoder_positions is None else blocks(max_encoder_positions),
            device=self.device)
        used = graphs.capture() if capture else 0
        self.graphs = graphs
        return used

    def release_idle(self) -> None:
        """Nothing is running: the backend drops what it keeps between steps (head-major copies)."""
        release = getattr(self.backend, "release", None)
        if release is not None:
            release()

    # -- input preparation ---------------------------------------------------
    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return host_to_device(array, self.device)

    def _view(self, query_start_loc: np.ndarray, key_lens: np.ndarray, causal: bool, **arrays) -> AttentionView:
        return AttentionView.from_arrays(query_start_loc, key_lens, causal, self.device, **arrays)

    def _decoder_arrays(self, rows: list[StepRow]) -> tuple[TokenArrays, np.ndarray]:
        data = [r.group.seq_data[r.seq_id] for r in rows]
        block_table = pad_rows([r.group.block_tables[r.seq_id] for r in rows])
        num_computed = np.array([d.num_computed_tokens for d in data], dtype=np.int64)
        num_scheduled = np.array([len(d) if r.group.token_chunk_size is None else d.num_computed_tokens
                                  + r.group.token_chunk_size for r, d in zip(rows, data)], dtype=np.int64) - num_computed
        arrays = prepare_token_arrays(num_scheduled, num_computed, block_table, self.block_size,
                                      pad_rows([d.token_ids for d in data]))
        return arrays, block_table

    def prepare_prefill(self, rows: list[StepRow]) -> ModelInput:
        dec, block_table = self._decoder_arrays(rows)
        has_prefix = bool(dec.num_computed_tokens.any())
        decoder = self._view(
            dec.query_start_loc, dec.seq_lens, causal=True, slot_mapping=dec.slot_mapping,
            block_tables=block_table if has_prefix else None,
            key_start_loc=None if has_prefix else dec.query_start_loc[:-1],
        )
        metadata = AttentionMetadata(decoder=decoder, block_size=self.block_size)
        encoder_inputs = None
        groups = list({id(r.group): r.group for r in rows}.values())
        if groups[0].encoder_seq_data is not None:
            encoder_inputs, metadata.encoder, metadata.cross = self._prepare_encoder(groups, rows, dec)
        no_speech_rows, probe_indices = self._no_speech_probes(rows, dec)
        prompt_rows, prompt_indices = self._prompt_positions(rows, dec)
        captures = self._captures(rows, dec)
        if captures:
            metadata.capture = CrossCapture([c for _, c in captures])
        return ModelInput(
            input_ids=self._tensor(dec.input_ids), positions=self._tensor(dec.positions), metadata=metadata,
            logits_indices=self._tensor(np.concatenate([dec.query_start_loc[1:] - 1, probe_indices, prompt_indices])),
            encoder_inputs=encoder_inputs, no_speech_rows=no_speech_rows, prompt_logprob_rows=prompt_rows,
            captures=captures,
        )

    @staticmethod
    def _whole_prompt(row: StepRow, dec: TokenArrays, i: int, what: str) -> int:
        """The prompt length of a row that must compute its whole prompt in this prefill."""
        if int(dec.num_computed_tokens[i]) != 0:
            raise RuntimeError(f"{what} of request {row.group.request_id} needs the whole prompt computed, "
                               "but this prefill starts from a cached prefix")
        return len(row.group.seq_data[row.seq_id].prompt_token_ids)

    def _prompt_positions(self, rows: list[StepRow], dec: TokenArrays) -> tuple[list[tuple[int, int]], np.ndarray]:
        """Rows reporting prompt logprobs (first prefill only), and the flat index of every prompt
        position whose logits predict the next prompt token."""
        found, indices = [], []
        for i, r in enumerate(rows):
            if r.group.probes is None or r.group.probes.prompt_logprobs is None:
                continue
            count = self._whole_prompt(r, dec, i, "prompt_logprobs") - 1
            found.append((i, count))
            indices.append(int(dec.query_start_loc[i]) + np.arange(count))
        return found, np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64)

    def _captures(self, rows: list[StepRow], dec: TokenArrays) -> list[tuple[int, CaptureRequest]]:
        captures = []
        for i, r in enumerate(rows):
            pairs = r.group.probes.cross_attention_heads if r.group.probes is not None else None
            if pairs is None:
                continue
            count = self._whole_prompt(r, dec, i, "cross_attention_heads")
            heads: dict[int, list[int]] = {}
            for layer, head in pairs:
                heads.setdefault(layer, []).append(head)
            keys = prepare_token_arrays(np.array([r.group.encoder_seq_data.num_positions]), np.zeros(1),
                                        pad_rows([r.group.cross_block_table]), self.block_size)
            start = int(dec.query_start_loc[i])
            captures.append((i, CaptureRequest(heads, start, start + count, self._tensor(keys.slot_mapping))))
        return captures

    @staticmethod
    def _no_speech_probes(rows: list[StepRow], dec: TokenArrays) -> tuple[list[int], np.ndarray]:
        """Rows that asked for no_speech_prob, and the flat index of each one's probed prompt token."""
        found = [(i, r.group.probes.no_speech_position) for i, r in enumerate(rows)
                 if r.group.probes is not None and r.group.probes.no_speech_position is not None]
        # A chunk of a prompt before the probed position leaves the probe to a later chunk.
        found = [(i, position) for i, position in found
                 if rows[i].group.token_chunk_size is None
                 or position < int(dec.num_computed_tokens[i] + dec.num_scheduled_tokens[i])]
        indices = []
        for i, position in found:
            offset = position - int(dec.num_computed_tokens[i])
            if not 0 <= offset < int(dec.num_scheduled_tokens[i]):
                raise RuntimeError(f"no-speech position {position} of request {rows[i].group.request_id} "
                                   "is not among the tokens this prefill computes")
            indices.append(int(dec.query_start_loc[i]) + offset)
        return [i for i, _ in found], np.array(indices, dtype=np.int64)

    def _prepare_encoder(self, groups, rows: list[StepRow], dec: TokenArrays):
        """Encoder inputs and views. Groups whose cross KV is already cached skip the encoder;
        then the cross view reads every group's cross cache (the fresh K/V are stored first)."""
        to_encode = [g for g in groups if not g.encoder_cached]
        group_index = {id(g): i for i, g in enumerate(groups)}
        seq_group = np.array([group_index[id(r.group)] for r in rows], dtype=np.int64)
        enc_lens_all = np.array([g.encoder_seq_data.num_positions for g in groups], dtype=np.int64)
        inputs = encoder = None
        slots = None
        if to_encode:
            encs = [g.encoder_seq_data for g in to_encode]
            enc_lens = np.array([e.num_positions for e in encs], dtype=np.int64)
            token_table = pad_rows([e.prompt_token_ids for e in encs]) if encs[0].features is None else None
            enc = prepare_token_arrays(enc_lens, np.zeros_like(enc_lens),
                                       pad_rows([g.cross_block_table for g in to_encode]), self.block_size,
                                       token_table)
            encoder = self._view(enc.query_start_loc, enc_lens, causal=False, key_start_loc=enc.query_start_loc[:-1])
            slots = enc.slot_mapping
            if token_table is not None:
                inputs = EncoderInputs(input_ids=self._tensor(enc.input_ids), positions=self._tensor(enc.positions))
            else:
                inputs = EncoderInputs(features=stack_features([e.features for e in encs], self.device))
        if len(to_encode) == len(groups):
            # Each decoder sequence attends to its group's fresh encoder segment.
            cross = self._view(dec.query_start_loc, enc_lens_all[seq_group], causal=False, slot_mapping=slots,
                               key_start_loc=enc.query_start_loc[seq_group])
        else:
            cross = self._view(dec.query_start_loc, enc_lens_all[seq_group], causal=False, slot_mapping=slots,
                               block_tables=pad_rows([r.group.cross_block_table for r in rows]))
        return inputs, encoder, cross

    def decode_batch(self, rows: list[StepRow]) -> DecodeBatch:
        """Each sequence's last token, at position len - 1, into the self-cache slot of that position."""
        data = [r.group.seq_data[r.seq_id] for r in rows]
        block_table = pad_rows([r.group.block_tables[r.seq_id] for r in rows])
        seq_lens = np.array([len(d) for d in data], dtype=np.int64)
        dec = prepare_token_arrays(np.ones(len(rows), dtype=np.int64), seq_lens - 1, block_table, self.block_size)
        input_ids = np.array([(d.output_token_ids or d.prompt_token_ids)[-1] for d in data], dtype=np.int64)
        batch = DecodeBatch(input_ids=input_ids, positions=dec.positions, slot_mapping=dec.slot_mapping,
                            block_tables=block_table, seq_lens=dec.seq_lens, seq_ids=[r.seq_id for r in rows])
        if rows[0].group.encoder_seq_data is not None:
            batch.encoder_lens = np.array([r.group.encoder_seq_data.num_positions for r in rows], dtype=np.int64)
            batch.cross_block_tables = pad_rows([r.group.cross_block_table for r in rows])
        return batch

    def prepare_decode(self, batch: DecodeBatch) -> ModelInput:
        query_start_loc = np.arange(batch.num_seqs + 1, dtype=np.int64)
        decoder = self._view(query_start_loc, batch.seq_lens, causal=True, slot_mapping=batch.slot_mapping,
                             block_tables=batch.block_tables)
        decoder.seq_ids = batch.seq_ids
        metadata = AttentionMetadata(decoder=decoder, block_size=self.block_size)
        if batch.encoder_lens is not None:
            metadata.cross = self._view(query_start_loc, batch.encoder_lens, causal=False,
                                        block_tables=batch.cross_block_tables)
        return ModelInput(
            input_ids=self._tensor(batch.input_ids), positions=self._tensor(batch.positions), metadata=metadata,
            logits_indices=self._tensor(query_start_loc[1:] - 1),
        )

    # -- execution -----------------------------------------------------------
    @torch.inference_mode()
    def execute(self, metadata_list: list[SequenceGroupMetadata]) -> StepOutput:
        """Run one step: its prefills (`is_prompt`, first in the list) in one forward, its decodes in
        another. Each row gets its samples (several for a request that forks into best_of sequences at
        its first token) or, in beam search, its processed log-probs; a chunk of a prompt that is not
        its last samples nothing. A prefill also reports what its requests asked for (no-speech
        probability, prompt logprobs, attention). A raise here fails the whole step; a failure of one
        row's own work is reported on it."""
        rows = [StepRow(m, seq_id, g) for g, m in enumerate(metadata_list) for seq_id in m.seq_data]
        num_prefill = sum(1 for r in rows if r.group.is_prompt)
        step = StepOutput([])
        hidden = []
        if num_prefill:
            prefill = rows[:num_prefill]
            inp = self.prepare_prefill(prefill)
            prefill_hidden = self._forward(inp)
            self._probe(prefill, inp, prefill_hidden[num_prefill:], step)
            hidden.append(prefill_hidden[:num_prefill])
        if num_prefill < len(rows):
            batch = self.decode_batch(rows[num_prefill:])
            if self.graphs is not None and self.graphs.fits(batch):
                hidden.append(self.graphs.run(batch))
                self.graph_steps += 1
            else:
                hidden.append(self._forward(self.prepare_decode(batch)))
        # Chunks that sample nothing need no logits.
        outputs = [RowOutput(r.group_index, r.seq_id, prefill_chunk=r.group.token_chunk_size) for r in rows]
        live = [i for i, r in enumerate(rows) if r.group.token_chunk_size is None]
        if not live:
            step.rows = outputs
            return step
        hidden = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        # The probes get their own logits call: the sampled rows' matmul keeps its shape (and its bits).
        logits = self.model.compute_logits(hidden if len(live) == len(rows) else hidden[live])
        sampling = [self._sampling_row(rows[i]) for i in live]
        beam = [j for j, i in enumerate(live) if rows[i].group.sampling_params.use_beam_search]
        if beam:
            log_probs, errors = beam_log_probs(logits[beam], [sampling[j] for j in beam])
            for k, j in enumerate(beam):
                outputs[live[j]].beam_log_probs, outputs[live[j]].error = log_probs[k], errors.get(k)
        sampled = [j for j, i in enumerate(live) if not rows[i].group.sampling_params.use_beam_search]
        if sampled:
            idx = [j for j in sampled for _ in range(rows[live[j]].group.fanout)]
            # The sampler edits its logits in place; the beam rows took their copy above.
            rows_logits = logits if idx == list(range(len(live))) else logits[idx]
            samples = iter(self.sampler(rows_logits, [sampling[j] for j in idx]))
            for j in sampled:
                row = rows[live[j]]
                outputs[live[j]] = RowOutput(row.group_index, row.seq_id,
                                             [next(samples) for _ in range(row.group.fanout)])
        step.rows = outputs
        return step

    def _forward(self, inp: ModelInput) -> torch.Tensor:  # [len(logits_indices), hidden]
        self.backend.plan(inp.metadata)
        encoder_hidden = None
        if inp.encoder_inputs is not None:
            encoder_hidden = self.model.encode(inp.encoder_inputs, inp.metadata)
        hidden = self.model(inp.input_ids, inp.positions, self.cache.kv_caches, inp.metadata, encoder_hidden)
        return hidden[inp.logits_indices]

    def _probe(self, rows: list[StepRow], inp: ModelInput, extra_hidden: torch.Tensor, step: StepOutput) -> None:
        """What a prefill reports besides its samples, into `step`: no-speech probabilities, prompt
        logprobs and captured cross-attention, per group. The extra rows get their own logits call, so
        the sampled rows' matmul keeps its shape (and its bits). One request's failure here is reported
        on it alone."""
        def report(i: int, compute) -> None:
            out = step.probes.setdefault(rows[i].group_index, ProbeResults())
            try:
                compute(out)
            except Exception as e:
                step.probe_errors[rows[i].group_index] = f"{type(e).__name__}: {e}"

        for i, req in inp.captures:
            heads = list(rows[i].group.probes.cross_attention_heads)
            report(i, lambda out: setattr(out, "cross_attentions", inp.metadata.capture.result(req, heads)))
        if not inp.no_speech_rows and not inp.prompt_logprob_rows:
            return
        logits = self.model.compute_logits(extra_hidden).float()
        probes, logits = logits[: len(inp.no_speech_rows)], logits[len(inp.no_speech_rows) :]
        if inp.no_speech_rows:
            # no_speech_prob: the raw distribution after the decoder start token, at the no-speech token.
            token_ids = [rows[i].group.probes.no_speech_token_id for i in inp.no_speech_rows]
            probs = probes.log_softmax(dim=-1).gather(1, torch.tensor(token_ids, device=probes.device)[:, None])
            for i, prob in zip(inp.no_speech_rows, probs[:, 0].exp().tolist()):
                report(i, lambda out: setattr(out, "no_speech_prob", prob))
        for i, count in inp.prompt_logprob_rows:  # the first prompt token has nothing to predict it: None
            row_logits, logits = logits[:count], logits[count:]
            report(i, lambda out: setattr(out, "prompt_logprobs",
                                          [None] + (self._prompt_logprobs(rows[i], row_logits) if count else [])))

    @staticmethod
    def _prompt_logprobs(row: StepRow, logits: torch.Tensor) -> list[dict[int, float]]:
        """vLLM's prompt_logprobs: each next prompt token's raw log-prob, plus the top-k; over
        allowed_token_ids when the request has them (a prompt token outside gets -inf)."""
        allowed = row.group.sampling.allowed
        if allowed is not None:  # the distribution over the tokens the request may generate
            keep = torch.full((logits.shape[-1],), float("-inf"), device=logits.device)
            keep[allowed] = 0.0
            logits = logits + keep
        logprobs = logits.log_softmax(dim=-1)
        prompt = row.group.seq_data[row.seq_id].prompt_token_ids
        targets = torch.tensor(prompt[1:], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        k = row.group.probes.prompt_logprobs
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        out = []
        for token, lp, ids, values in zip(prompt[1:], chosen, top_ids.tolist(), top_values.tolist()):
            entry = dict(zip(ids, values))
            entry[token] = lp
            out.append(entry)
        return out

    @staticmethod
    def _sampling_row(row: StepRow) -> SamplingRow:
        m, data = row.group, row.group.seq_data[row.seq_id]
        return SamplingRow(m.sampling_params, data.prompt_token_ids, data.output_token_ids, m.sampling, m.max_len)
