"""How many KV blocks fit on the device, and what that pool holds.

On CUDA the pool gets what is left of this engine's share of the device after
the weights and the activation peak of the largest step::

    |<------------------- total device memory ---------------------->|
    |<--------- total * gpu_memory_utilization --------->|            |
    | weights | activation peak | KV pool (whole blocks) | slack      |  (other processes
                                                                         live in the slack)

The share is also capped by what was free for this engine (`free_bytes`), so
memory held by other processes is never planned for. The arithmetic is a pure
function; `profile_free_memory` takes the measurements around one profiling
forward pass (`profile_forward`: the largest step the scheduler may run),
through a reader that tests replace; `size_kv_pool` puts them together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from encdec_engine.quantization.kv_int8 import KV_QUANT_GROUP, tokens_ratio
from encdec_engine.attention.metadata import AttentionMetadata, AttentionView
from encdec_engine.models.interface import EncoderInputs, KVCacheSpec
from encdec_engine.worker.cache_engine import bytes_per_block

WHISPER_ENCODER_POSITIONS = 1500  # cross-cache positions of one 30 s window (3000 mel frames / conv stride 2)
DEFAULT_KV_CACHE_GB = 2.0  # pool size where nothing is profiled (CPU)
_GiB = 1 << 30
_MiB = 1 << 20


def num_kv_blocks_for_memory(
    free_bytes: int,  # device memory free for this engine now, its weights loaded
    total_bytes: int,  # device capacity
    gpu_memory_utilization: float,  # fraction of the device this engine may hold in all (vLLM: per instance)
    model_bytes: int,  # this engine's weights
    activation_peak_bytes: int,  # peak extra memory of the largest step (profiled, without KV)
    bytes_per_block: int,  # one block across all layers, K and V
) -> int:
    """Whole KV blocks that fit in the engine's share after weights and activations.

    The share is `gpu_memory_utilization` of the device whatever else runs on it; when
    other processes (or engines) leave less than that free, this is an error, as in vLLM,
    rather than a pool that takes every free byte and leaves no headroom.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    share = int(total_bytes * gpu_memory_utilization)
    if share - model_bytes > free_bytes:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization:g} gives this engine {_gib(share)} of "
            f"{_gib(total_bytes)}, but with its {_gib(model_bytes)} of weights loaded only {_gib(free_bytes)} are "
            "free (other processes or engines hold the rest); lower gpu_memory_utilization or free the device")
    kv_bytes = share - model_bytes - activation_peak_bytes
    blocks = kv_bytes // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {_gib(share)} ({gpu_memory_utilization:.0%} of {_gib(total_bytes)}) "
            f"minus {_gib(model_bytes)} of weights and {_gib(activation_peak_bytes)} of activations leaves less "
            "than one block; raise gpu_memory_utilization or lower max_num_batched_tokens")
    return int(blocks)


@dataclass(frozen=True)
class MemoryProfile:
    """Measurements of one profiling forward pass (bytes)."""

    free_bytes: int  # free for this engine, its weights loaded: device free plus this process's cached, unused memory
    total_bytes: int
    model_bytes: int  # this engine's weights
    activation_peak_bytes: int  # peak allocation during the forward pass, above what was allocated before


class MemoryReader(Protocol):
    """The few torch.cuda calls `profile_free_memory` needs (a fake one in tests)."""

    def synchronize(self) -> None: ...
    def reset_peak_memory_stats(self) -> None: ...
    def memory_allocated(self) -> int: ...
    def max_memory_allocated(self) -> int: ...
    def memory_reserved(self) -> int: ...
    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total)


class CudaMemoryReader:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)


def profile_free_memory(
    device: torch.device,
    run_profile_forward: Callable[[], None],  # the largest step the scheduler may run, without KV cache
    reader: MemoryReader | None = None,
    model_bytes: int | None = None,  # this engine's weights; None: everything allocated so far
) -> MemoryProfile:
    """Measure the activation peak of `run_profile_forward` and the memory free for this engine.

    Call with the weights loaded and before the KV pool exists. Memory this
    process's caching allocator holds but does not use counts as free; memory
    other engines of this process, other processes and the CUDA context use does not.
    """
    reader = reader or CudaMemoryReader(device)
    reader.synchronize()
    reader.reset_peak_memory_stats()
    before = reader.memory_allocated()
    run_profile_forward()
    reader.synchronize()
    peak = reader.max_memory_allocated()
    free, total = reader.mem_get_info()
    return MemoryProfile(free_bytes=free + reader.memory_reserved() - reader.memory_allocated(), total_bytes=total,
                         model_bytes=before if model_bytes is None else model_bytes,
                         activation_peak_bytes=max(0, peak - before))


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (tied tensors once; packed oneDNN weights,
    which have no data pointer, by their logical size)."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        seen[id(t) if t.is_mkldnn else t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


@torch.inference_mode()
def profile_forward(model, backend, block_size: int, device: torch.device, max_num_batched_tokens: int,
                    max_num_seqs: int, max_decoder_len: int) -> None:
    """The largest prefill step the scheduler may run, without KV caches (nothing is stored).

    Encoder/decoder: as many full-length encoder inputs (one decoder token each) as the
    token budget holds; decoder-only: as many full-length prompts.
    """
    if model.is_encoder_decoder:
        enc_len, dec_len = model.encoder_num_positions(model.max_encoder_len), 1
    else:
        enc_len, dec_len = 0, min(max_decoder_len, max_num_batched_tokens)
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens // (enc_len + dec_len)))
    dec_lens = np.full(num_seqs, dec_len, dtype=np.int64)
    metadata = AttentionMetadata(decoder=_fresh_view(dec_lens, dec_lens, True, device), block_size=block_size)
    encoder_hidden = None
    if model.is_encoder_decoder:
        enc_lens = np.full(num_seqs, enc_len, dtype=np.int64)
        metadata.encoder = _fresh_view(enc_lens, enc_lens, False, device)
        metadata.cross = _fresh_view(dec_lens, enc_lens, False, device)
        n_mels = getattr(model, "num_mel_bins", None)
        if n_mels is not None:  # audio: 2 mel frames per encoder position
            inputs = EncoderInputs(features=torch.zeros(num_seqs, n_mels, 2 * enc_len, device=device))
        else:
            inputs = EncoderInputs(input_ids=torch.zeros(num_seqs * enc_len, dtype=torch.long, device=device),
                                   positions=torch.arange(enc_len, device=device).repeat(num_seqs))
        backend.plan(metadata)
        encoder_hidden = model.encode(inputs, metadata)
    else:
        backend.plan(metadata)
    input_ids = torch.zeros(num_seqs * dec_len, dtype=torch.long, device=device)
    positions = torch.arange(dec_len, device=device).repeat(num_seqs)
    hidden = model(input_ids, positions, [None] * model.kv_cache_spec.num_layers, metadata, encoder_hidden)
    model.compute_logits(hidden[torch.arange(dec_len - 1, num_seqs * dec_len, dec_len, device=device)])


def _fresh_view(q_lens: np.ndarray, k_lens: np.ndarray, causal: bool, device: torch.device) -> AttentionView:
    q_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    k_loc = np.concatenate([[0], np.cumsum(k_lens)[:-1]]).astype(np.int64)
    return AttentionView(
        query_start_loc=torch.from_numpy(q_loc).to(device), key_lens=torch.from_numpy(k_lens).to(device),
        causal=causal, max_query_len=int(q_lens.max()), max_key_len=int(k_lens.max()),
        key_start_loc=torch.from_numpy(k_loc).to(device), query_start_loc_list=q_loc.tolist(),
        key_lens_list=k_lens.tolist(), key_start_loc_list=k_loc.tolist(),
    )


def size_kv_pool(
    spec: KVCacheSpec,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    num_kv_blocks: int | None,  # given: used as is
    kv_cache_space_gb: float | None,  # given (or not on CUDA): this many GiB of blocks
    gpu_memory_utilization: float,
    run_profile_forward: Callable[[], None],  # e.g. a closure over `profile_forward`
    cross_positions: int | None,  # one full request's cross cache; None for decoder-only models
    reader: MemoryReader | None = None,
    model_bytes: int | None = None,  # this engine's weights (profile_free_memory)
) -> KVPoolReport:
    """The KV pool's size: configured, or on CUDA whatever the profiled step leaves."""
    report = dict(spec=spec, block_size=block_size, dtype=dtype, cross_positions=cross_positions)
    if num_kv_blocks:
        return KVPoolReport(num_blocks=num_kv_blocks, **report)
    if kv_cache_space_gb is not None or device.type != "cuda":
        gb = DEFAULT_KV_CACHE_GB if kv_cache_space_gb is None else kv_cache_space_gb
        return KVPoolReport(num_blocks=max(1, int(gb * _GiB) // bytes_per_block(spec, block_size, dtype)), **report)
    memory = profile_free_memory(device, run_profile_forward, reader, model_bytes)
    blocks = num_kv_blocks_for_memory(memory.free_bytes, memory.total_bytes, gpu_memory_utilization,
                                      memory.model_bytes, memory.activation_peak_bytes,
                                      bytes_per_block(spec, block_size, dtype))
    return KVPoolReport(num_blocks=blocks, memory=memory, gpu_memory_utilization=gpu_memory_utilization, **report)


@dataclass(frozen=True)
class KVPoolReport:
    """What a KV pool holds, for the start-up log."""

    spec: KVCacheSpec
    block_size: int  # tokens per block
    dtype: torch.dtype
    num_blocks: int
    memory: MemoryProfile | None = None  # how the size was derived, when profiled
    gpu_memory_utilization: float | None = None
    cross_positions: int | None = WHISPER_ENCODER_POSITIONS  # one request's cross cache; None: decoder-only

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.spec, self.block_size, self.dtype)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def cross_blocks(self, num_positions: int = WHISPER_ENCODER_POSITIONS) -> int:
        """Blocks one request's cross cache takes."""
        return -(-num_positions // self.block_size)

    def describe(self) -> str:
        per_block = self.bytes_per_block
        dtype = str(self.dtype).removeprefix("torch.")
        if self.dtype == torch.int8:
            dtype += (f" with a float32 scale per {KV_QUANT_GROUP} dims: "
                      f"{tokens_ratio(self.spec.head_dim, self.dtype):.2f}x the tokens of float32")
        lines = [
            f"KV pool: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} token slots, "
            f"{_size(self.pool_bytes)} ({self.spec.num_layers} layers x {self.spec.num_kv_heads} KV heads x "
            f"head_dim {self.spec.head_dim}, {dtype}, {_size(per_block)}/block)",
        ]
        if self.cross_positions:
            n = self.cross_positions
            cross = self.cross_blocks(n)
            what = "a Whisper request's" if n == WHISPER_ENCODER_POSITIONS else "a full-length request's"
            lines.append(f"{what} cross cache ({n} positions) takes {cross} blocks ({_size(cross * per_block)}): "
                         f"at most {self.num_blocks // cross} such requests at once")
        if self.memory is not None and self.gpu_memory_utilization is not None:
            m = self.memory
            lines.append(
                f"sized for gpu_memory_utilization={self.gpu_memory_utilization:g} of {_gib(m.total_bytes)} "
                f"({_gib(m.free_bytes)} free): weights {_gib(m.model_bytes)}, "
                f"activation peak {_gib(m.activation_peak_bytes)}")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / _GiB:.2f} GiB"


def _size(n: int) -> str:
    for unit, scale in (("GiB", _GiB), ("MiB", _MiB)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"
