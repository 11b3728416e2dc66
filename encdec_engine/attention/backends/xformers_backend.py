"""CUDA backend: xformers flash attention for prefill, Triton for paged decode and the KV store.

Same views, same results as `TorchSDPABackend`; only the kernels differ:

    KV store             Triton slot-mapping scatter (`ops.kv_store`)
    fresh prefill        xformers `memory_efficient_attention` (flash op) with the
                         block-diagonal bias of `prefill_attn_bias(view)`; a cross
                         view whose sequences share one group's encoder segment gets
                         its K/V rows expanded per sequence first
    prefill over cache   K/V gathered from the cache into one packed batch, then the
                         same (bottom-right causal / rectangular) flash call
    decode               Triton paged attention over block tables (`ops.paged_attention`), a
                         position bias (T5, ALiBi) read from its table inside the kernel

The flash op only runs fp16/bf16 with head_dim % 8 == 0 on sm80+ and takes no additive
bias: a prefill with a position bias runs on torch SDPA (its mask made per sequence shape or per
padded batch, as on the CPU). Anything it
or the Triton kernels cannot serve (fp32 prefill, odd head sizes, CPU tensors)
goes to an internal `TorchSDPABackend`, logged once per reason; never silently.

Importing this module needs neither CUDA, xformers nor triton; constructing the
backend does (`BackendUnavailableError` otherwise).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from encdec_engine.attention.backends.torch_sdpa import FreshPlan, GatherPlan, TorchSDPABackend, plan_gather
from encdec_engine.attention.backends.xformers_masks import prefill_attn_bias
from encdec_engine.quantization.kv_int8 import as_stored, read_rows
from encdec_engine.attention.metadata import AttentionMetadata, AttentionView
from encdec_engine.attention.position_bias import PositionBias

logger = logging.getLogger(__name__)

_DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DECODE_CACHE_DTYPES = (*_DECODE_DTYPES, torch.int8)  # int8: dequantized inside the kernel
# The op's import-time check wants xformers' own C++ build; PyTorch's flash kernel does not need it.
_EXT_BUILD_REASON = "wasn't build with CUDA support"


class BackendUnavailableError(ImportError, RuntimeError):
    """The backend cannot run here (no CUDA device, or xformers/triton missing)."""


@dataclass
class _ViewPlan:
    """Work shared by every layer that reads one view in one step."""

    attn_bias: Any = None  # xformers bias over the packed prefill keys; None for decode
    key_index: torch.Tensor | None = None  # [num_keys] rows of the fresh K/V in bias order; None: already packed
    cache_slots: torch.Tensor | None = None  # [num_keys] cache slots of the packed keys of a prefill over the cache
    torch_plan: GatherPlan | FreshPlan | None = None  # the torch backend's plan, made on first fallback


class XFormersBackend:
    name = "xformers"
    supports_cuda_graphs = True  # decode: Triton store and paged kernels, grids from host shapes alone

    def __init__(self, block_size: int) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "the xformers attention backend needs a CUDA device and none is visible; "
                "use attention_backend='torch' (or 'auto') on CPU")
        self._init(block_size)

    def _init(self, block_size: int) -> None:
        try:
            from xformers.ops.fmha import flash
            from xformers.ops.fmha.common import Inputs

            from encdec_engine.attention.ops import kv_store, paged_attention  # lazy: triton, the gpu extra
        except ImportError as e:
            raise BackendUnavailableError(f"the xformers attention backend needs xformers and triton: {e}") from e
        self.block_size = block_size
        self._flash, self._inputs = flash, Inputs
        self._store_kv = kv_store.store_kv_triton
        self._paged_decode = paged_attention.paged_decode_attention
        self._kernels_on_cpu = paged_attention.INTERPRETED  # TRITON_INTERPRET=1: kernels take CPU tensors
        self._torch = TorchSDPABackend(block_size)
        self._flash_reasons: dict[tuple, str] = {}  # input signature -> why flash refuses it ("" = it serves it)
        self._logged: set[tuple[str, str]] = set()

    # -- planning ------------------------------------------------------------
    def plan(self, metadata: AttentionMetadata) -> None:
        for view in (metadata.encoder, metadata.decoder, metadata.cross):
            if view is not None:
                view.plan = self._plan_view(view)

    def _plan_view(self, view: AttentionView) -> _ViewPlan:
        if view.reads_cache and view.max_query_len == 1:
            return _ViewPlan()  # decode: the kernel reads block tables directly
        bias = prefill_attn_bias(view).to(view.key_lens.device)
        if view.reads_cache:
            return _ViewPlan(bias, cache_slots=packed_cache_slots(view, self.block_size))
        return _ViewPlan(bias, key_index=packed_key_index(view))

    # -- forward -------------------------------------------------------------
    def forward(self, query, key, value, kv_cache, view: AttentionView, scale: float,
                position_bias: PositionBias | None = None) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim]; key/value: [num_kv_tokens, num_kv_heads, head_dim] or None
        if not (query.is_cuda or self._kernels_on_cpu):
            self._log_fallback(f"{query.device.type} tensors", view)  # e.g. device="cpu" with this backend forced
            return self._torch.forward(query, key, value, kv_cache, replace(view, plan=None), scale, position_bias)
        if key is not None and view.slot_mapping is not None and kv_cache is not None:
            self._store_kv(key, value, kv_cache, view.slot_mapping)
            if not view.reads_cache:  # attend to the K/V as the cache holds them (int8: rounded)
                key, value = as_stored(key, kv_cache.dtype), as_stored(value, kv_cache.dtype)
        plan = view.plan if isinstance(view.plan, _ViewPlan) else self._plan_view(view)
        if view.reads_cache and view.max_query_len == 1:
            if query.dtype not in _DECODE_DTYPES or kv_cache.dtype not in _DECODE_CACHE_DTYPES:
                return self._fallback(str(kv_cache.dtype), query, None, None, kv_cache, view, scale, plan,
                                      position_bias)
            return self._paged_decode(query, kv_cache, view.block_tables, view.key_lens, scale, self.block_size,
                                      max_key_len=view.max_key_len, position_bias=position_bias)
        if position_bias is not None:  # the flash op takes no additive bias
            return self._fallback("a position bias", query, key, value, kv_cache, view, scale, plan, position_bias)
        num_kv_heads = kv_cache.shape[-2] if view.reads_cache else key.shape[1]
        signature = (query.dtype, query.device, tuple(query.shape[1:]), num_kv_heads, type(plan.attn_bias))
        if self._flash_reasons.get(signature):  # a known refusal: skip packing K/V
            return self._fallback(self._flash_reasons[signature], query, key, value, kv_cache, view, scale, plan)
        k, v = self._packed_kv(key, value, kv_cache, view, plan, query.shape[-1], query.dtype)
        q5, k5, v5 = _to_bmghk(query, k.to(query.dtype), v.to(query.dtype))
        if signature not in self._flash_reasons:
            self._flash_reasons[signature] = self._flash_unsupported(q5, k5, v5, plan.attn_bias)
            if self._flash_reasons[signature]:
                return self._fallback(self._flash_reasons[signature], query, key, value, kv_cache, view, scale, plan)
        return self._flash_forward(q5, k5, v5, plan.attn_bias, scale).reshape(query.shape)

    def _packed_kv(self, key, value, kv_cache, view: AttentionView, plan: _ViewPlan, head_dim: int,
                   dtype: torch.dtype):
        """Each sequence's keys back to back: read from the cache (dequantized if int8), expanded, or the
        fresh K/V as they are."""
        if view.reads_cache:
            num_kv_heads, width = kv_cache.shape[-2:]
            k = kv_cache[0].view(-1, num_kv_heads, width).index_select(0, plan.cache_slots)
            v = kv_cache[1].view(-1, num_kv_heads, width).index_select(0, plan.cache_slots)
            return read_rows(k, head_dim, dtype), read_rows(v, head_dim, dtype)
        if plan.key_index is not None:
            return key.index_select(0, plan.key_index), value.index_select(0, plan.key_index)
        total = sum(view.key_lens_list)
        return key[:total], value[:total]

    def _flash_forward(self, q, k, v, attn_bias, scale: float) -> torch.Tensor:
        """The flash op, called directly: dispatch would refuse it for want of xformers' own C++ build."""
        inp = self._inputs(query=q, key=k, value=v, attn_bias=attn_bias, scale=scale)
        inp.validate_inputs()
        out, _ = self._flash.FwOp.apply(inp, needs_gradient=False)
        return out

    def _flash_unsupported(self, q, k, v, attn_bias) -> str:
        """Why the flash op cannot run these inputs ("" if it can), in xformers' own words."""
        reasons = self._flash.FwOp.not_supported_reasons(self._inputs(query=q, key=k, value=v, attn_bias=attn_bias))
        if self._flash._USE_PT_FLASH_ATTN:
            reasons = [r for r in reasons if _EXT_BUILD_REASON not in r]
        return "; ".join(reasons)

    def _fallback(self, reason: str, query, key, value, kv_cache, view: AttentionView, scale: float,
                  plan: _ViewPlan, position_bias: PositionBias | None = None) -> torch.Tensor:
        """Attend on torch SDPA (new K/V are already stored), saying so once per reason."""
        self._log_fallback(reason, view)
        plan.torch_plan = plan.torch_plan or (plan_gather(view, self.block_size) if view.reads_cache else FreshPlan())
        torch_plan = plan.torch_plan
        return self._torch.forward(query, key, value, kv_cache, replace(view, slot_mapping=None, plan=torch_plan),
                                   scale, position_bias)

    def _log_fallback(self, reason: str, view: AttentionView) -> None:
        step = "decode" if view.reads_cache and view.max_query_len == 1 else "prefill"
        if (step, reason) not in self._logged:
            self._logged.add((step, reason))
            logger.warning("xformers backend: %s with %s is not served by its kernels; using torch SDPA for it",
                           step, reason)


def packed_key_index(view: AttentionView) -> torch.Tensor | None:
    """Rows of the fresh K/V that lay each sequence's keys out back to back ([sum key_lens]),
    or None when `key_start_loc` already does (cross views of groups with several
    sequences point them all at one encoder segment)."""
    starts, lens = view.key_start_loc_list, view.key_lens_list
    packed, offset = True, 0
    for start, n in zip(starts, lens):
        packed &= start == offset
        offset += n
    if packed:
        return None
    idx = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, lens)])
    return idx.to(view.key_lens.device, non_blocking=True)


def packed_cache_slots(view: AttentionView, block_size: int) -> torch.Tensor:
    """Cache slots of every sequence's keys, back to back ([sum key_lens])."""
    device = view.block_tables.device
    lens = view.key_lens.to(torch.int64)
    num_keys = sum(view.key_lens_list)  # host-side: no device sync for the output size
    seq = torch.repeat_interleave(torch.arange(view.num_seqs, device=device), lens, output_size=num_keys)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(num_keys, device=device) - starts[seq]  # position within its sequence
    blocks = view.block_tables[seq, pos // block_size].to(torch.int64)
    return blocks * block_size + pos % block_size


def _to_bmghk(query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, H, D] -> xformers' [1, T, H, D], or [1, T, Hkv, H/Hkv, D] with K/V broadcast for GQA."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_heads == num_kv_heads:
        return query[None], key[None], value[None]
    group = num_heads // num_kv_heads
    q = query.reshape(1, num_tokens, num_kv_heads, group, head_dim)
    shape = (1, key.shape[0], num_kv_heads, group, head_dim)
    return q, key[None, :, :, None].expand(shape), value[None, :, :, None].expand(shape)
