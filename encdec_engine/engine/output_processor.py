"""Applying a step's results to its requests, one request at a time, and building RequestOutputs.

Per request: the prefill's reports (no-speech probability, prompt logprobs,
cross-attention), then per row its sampled tokens (or, for a chunk of a prompt,
the prompt tokens it computed) (forking a best_of request
at its first token), incremental detokenizing and the stop checks, or a beam
search step. An exception anywhere in one request's part, or an error the
runner reported on one of its rows, ends that request alone with
finish_reason "error" and a message (`RequestOutput.error`); its blocks are
freed with the finished groups, and the other requests go on.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch

from encdec_engine.engine.block_manager import BlockManager
from encdec_engine.engine.detokenizer import Detokenizer
from encdec_engine.outputs import CompletionOutput, RequestOutput
from encdec_engine.sequence import SequenceStatus
from encdec_engine.engine.sequence_group import Sequence, SequenceGroup
from encdec_engine.probes import ProbeResults
from encdec_engine.worker.step_output import RowOutput, StepOutput

logger = logging.getLogger(__name__)


class RequestFailure(RuntimeError):
    """Raised inside one request's part of a step: that request ends with finish_reason "error"."""


class OutputProcessor:
    def __init__(self, block_manager: BlockManager, tokenizer, new_seq_id: Callable[[], int]) -> None:
        self.block_manager = block_manager
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.new_seq_id = new_seq_id

    # -- applying a step -------------------------------------------------------
    def apply(self, groups: list[SequenceGroup], step: StepOutput, now: float) -> None:
        """Apply each group's rows (groups in the step's metadata order)."""
        rows: dict[int, list[RowOutput]] = defaultdict(list)
        for row in step.rows:
            rows[row.group_index].append(row)
        for i, group in enumerate(groups):
            try:
                self._apply_group(group, rows[i], step.probes.get(i), step.probe_errors.get(i), now)
            except Exception as e:
                self.fail(group, e)

    def fail(self, group: SequenceGroup, error: BaseException | str, log: bool = True) -> None:
        """End the group with finish_reason "error"; the scheduler frees it with the finished groups."""
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if not log:
            pass
        elif isinstance(error, BaseException) and not isinstance(error, RequestFailure):
            logger.error("request %s failed; it alone is ended", group.request_id, exc_info=error)
        else:
            logger.error("request %s failed (%s); it alone is ended", group.request_id, message)
        group.error = message
        for seq in group.unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ERROR

    def _apply_group(self, group: SequenceGroup, rows: list[RowOutput], probes: ProbeResults | None,
                     probe_error: str | None, now: float) -> None:
        failed = next((r.error for r in rows if r.error is not None), None) or probe_error
        if failed:
            raise RequestFailure(failed)
        if probes is not None:
            group.probe_results.update(probes)
        seqs = {s.seq_id: s for s in group.seqs}
        if any(r.prefill_chunk is not None for r in rows):  # a chunk of its prompt: computed, nothing sampled
            for row in rows:
                seqs[row.seq_id].data.num_computed_tokens += row.prefill_chunk
            return
        if group.first_token_time is None:
            group.first_token_time = now
        for row in rows:
            seqs[row.seq_id].data.num_computed_tokens = len(seqs[row.seq_id])
        if group.beam is not None:
            self._beam_step(group, [(seqs[r.seq_id], r.beam_log_probs) for r in rows])
            return
        for row in rows:
            seq = seqs[row.seq_id]
            # Fork before appending, so children copy the parent as it was.
            targets = [seq] + [self._fork(group, seq) for _ in row.samples[1:]]
            for target, sample in zip(targets, row.samples):
                target.append_token(sample.token_id, sample.logprob, sample.top_logprobs)
                self._check_stop(target, group)
                if target.is_finished():  # its blocks go back now, not when the whole group is done
                    self.block_manager.free(target)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        """A new sequence that shares the parent's tokens and KV blocks (copy-on-write)."""
        child = parent.fork(self.new_seq_id())
        self.block_manager.fork(parent, child)
        group.seqs.append(child)
        return child

    def _beam_step(self, group: SequenceGroup, rows: list[tuple[Sequence, torch.Tensor]]) -> None:
        seqs = [seq for seq, _ in rows]
        step = group.beam.step(torch.stack([r for _, r in rows]), [s.output_token_ids for s in seqs])
        # Each new beam extends a parent: the first claim reuses the parent, later ones fork it.
        claimed: set[int] = set()
        children = []
        for parent_index in step.parents:
            parent = seqs[parent_index if len(seqs) > 1 else 0]
            if parent.seq_id in claimed:
                children.append(self._fork(group, parent))
            else:
                claimed.add(parent.seq_id)
                children.append(parent)
        for seq in seqs:
            if seq.seq_id not in claimed:  # pruned beam
                self.block_manager.free(seq)
        group.seqs = children  # beam order: the next step's rows line up with the beam scores
        for child, token in zip(children, step.tokens):
            child.append_token(token, 0.0, None)
            if step.done:
                child.status = SequenceStatus.FINISHED_STOPPED

    def _check_stop(self, seq: Sequence, group: SequenceGroup) -> None:
        params, sampling = group.sampling_params, group.sampling
        token = seq.output_token_ids[-1]
        delta = ""
        if self.detokenizer is not None:
            delta = self.detokenizer.step(seq, params.skip_special_tokens)
        if len(seq.output_token_ids) >= params.min_tokens:
            if token in sampling.stop_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = None if token in sampling.eos_token_ids else token
                if delta and not params.include_stop_str_in_output:  # vLLM: the stop token's text is left out
                    seq.output_text = seq.output_text[: -len(delta)]
                elif (self.detokenizer is not None and params.skip_special_tokens
                      and token in self.detokenizer.special_ids):  # a special token, not in the text, ended it
                    self.detokenizer.flush(seq)
                return
            if params.stop and delta and _hit_stop_string(seq, params.stop, params.include_stop_str_in_output,
                                                          len(delta)):
                return
        if len(seq) >= group.max_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            if self.detokenizer is not None:
                self.detokenizer.flush(seq)

    # -- outputs ---------------------------------------------------------------
    def output(self, group: SequenceGroup) -> RequestOutput:
        """The request's state as a RequestOutput. Building it is the request's own work too: if that
        raises (detokenizing a beam), the request fails and gets the output of a failed request."""
        try:
            return self._output(group)
        except Exception as e:
            self.fail(group, e)
            return self._output(group)

    def _output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        seqs = group.seqs
        if group.is_finished() and params.best_of > params.n and group.error is None:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        if group.beam is not None and group.is_finished() and group.error is None:
            outputs = self._beam_outputs(group)
        else:
            outputs = [
                CompletionOutput(
                    index=i, text=s.output_text, token_ids=list(s.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob if params.logprobs is not None else None,
                    logprobs=list(s.output_logprobs) if params.logprobs is not None else None,
                    finish_reason=s.status.finish_reason, stop_reason=s.stop_reason,
                    error=group.error if s.status == SequenceStatus.FINISHED_ERROR else None,
                )
                for i, s in enumerate(seqs)
            ]
        first = group.seqs[0]
        enc = group.encoder_seq
        metrics = {"arrival_time": group.arrival_time}
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        if group.finished_time is not None:
            metrics["finished_time"] = group.finished_time
        return RequestOutput(
            request_id=group.request_id, prompt=first.prompt, prompt_token_ids=list(first.data.prompt_token_ids),
            encoder_prompt=enc.prompt if enc else None,
            encoder_prompt_token_ids=list(enc.prompt_token_ids) if enc and enc.prompt_token_ids else None,
            outputs=outputs, finished=group.is_finished(), metrics=metrics,
            probes=replace(group.probe_results) if group.probes is not None else None, error=group.error,
        )

    def _beam_outputs(self, group: SequenceGroup) -> list[CompletionOutput]:
        params = group.sampling_params
        outputs = []
        for i, (tokens, score) in enumerate(group.beam.best(params.n)):
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
            reason = "stop" if tokens and tokens[-1] in group.beam.eos_token_ids else "length"
            # As vLLM: cumulative_logprob is the beam's summed log-probability; the ranking divided it
            # by length ** length_penalty (HF's sequences_scores).
            total = score * max(1, len(tokens)) ** params.length_penalty
            outputs.append(CompletionOutput(i, text, tokens, total, None, reason))
        return outputs


def _hit_stop_string(seq: Sequence, stops: list[str], include: bool, delta_len: int) -> bool:
    """End the sequence at the first stop string in its text. Only the window a new match can lie in
    is searched (the new text plus a stop's length before it): O(new text) per token."""
    text = seq.output_text
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
        if idx >= 0:
            seq.output_text = text[: idx + len(stop)] if include else text[:idx]
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            return True
    return False
