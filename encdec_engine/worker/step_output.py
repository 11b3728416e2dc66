"""What one step of the model runner gives back: a result per row, applied by the engine request by request.

The runner never writes into a request; it reports. A row whose own work failed
(its logits processors, its prompt logprobs) carries an `error`, and only its
request fails; the other rows' results are as if it had not been there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from encdec_engine.layers.sampler import SampleResult
from encdec_engine.probes import ProbeResults


@dataclass
class RowOutput:
    """The result of one scheduled decoder sequence."""

    group_index: int  # its group's index in the step's metadata list
    seq_id: int
    samples: list[SampleResult] = field(default_factory=list)  # best_of of them at a forking first token
    beam_log_probs: torch.Tensor | None = None  # [vocab] processed log-probs, for beam search instead
    error: str | None = None
    prefill_chunk: int | None = None  # a chunk of a prompt, sampling nothing: this many prompt tokens computed

    def __post_init__(self) -> None:
        if self.error is None:
            self.error = next((s.error for s in self.samples if s.error is not None), None)


@dataclass
class StepOutput:
    rows: list[RowOutput]
    probes: dict[int, ProbeResults] = field(default_factory=dict)  # group index -> what its prefill reported
    probe_errors: dict[int, str] = field(default_factory=dict)  # group index -> why a probe of it failed
