"""Engine configuration: one dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encdec_engine.compute_types import fold_compute_type

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str  # checkpoint folder (or hub id when online)
    tokenizer: str | None = None  # defaults to the model folder
    # auto | float32 | bfloat16 | float16 | fastest (auto: float32 on CPU, bfloat16 on CUDA; fastest: on the CPU
    # bfloat16 where native and faster here, else float32, resolved by the engine at start)
    dtype: str = "auto"
    compute_type: str | None = None  # faster-whisper's spelling of quantization + dtype (COMPUTE_TYPES)
    device: str = "auto"  # auto | cpu | cuda[:N]
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV pool size in blocks; default: kv_cache_space_gb, or profiled on CUDA
    kv_cache_space_gb: float | None = None  # KV pool size in GiB; default 2 on CPU, profiled on CUDA
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device for weights + activations + KV pool
    swap_space_gb: float = 0.0  # CPU swap pool for preempted requests (0: recompute instead)
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int | None = None  # prefill tokens (decoder + encoder) in one step
    # Mixed steps: every decode gets its token, prefills the budget left, a long decoder prompt a chunk
    # per step (engine/scheduler.py)
    enable_chunked_prefill: bool = False
    # Admit a request only while the pool keeps room for what the running sequences are expected to still
    # write (engine/scheduler.py); False: while it holds the prompts (vLLM's rule), growth preempting
    reserve_decode_growth: bool = True
    max_model_len: int | None = None  # decoder positions; default: the model's limit
    seed: int = 0  # for unseeded random sampling
    skip_tokenizer_init: bool = False  # token ids in, token ids out
    attention_backend: str = "auto"  # auto | torch | xformers
    enable_prefix_caching: bool = True  # reuse cached encoder outputs (cross KV) and decoder prefixes
    enforce_eager: bool = False  # CUDA: never replay decode from CUDA graphs
    quantization: str | None = None  # "int8": CPU linears on int8 weights, per-channel scales (quantization/int8_weights.py)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 (per-group scales, quantization/kv_int8.py)
    # torch's CPU threads (set for the whole process before the model loads); None: $OMP_NUM_THREADS when
    # set, else the cores this process may use (os.sched_getaffinity)
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "fastest") and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto', 'fastest' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.compute_type is not None:
            self.quantization, self.dtype = fold_compute_type(self.compute_type, self.quantization, self.dtype)
            self.compute_type = None
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but no CUDA device is available")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_space_gb is not None and self.kv_cache_space_gb <= 0:
            raise ValueError(f"kv_cache_space_gb must be positive, got {self.kv_cache_space_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be non-negative, got {self.swap_space_gb}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool)
                                         or self.threads < 1):
            raise ValueError(f"threads must be a positive integer (or None: the cores this process may use), "
                             f"got {self.threads!r}")
        if self.attention_backend not in ("auto", "torch", "xformers"):
            raise ValueError(f"attention_backend must be auto, torch or xformers, got {self.attention_backend!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.quantization == "int8" and self.torch_device.type != "cpu":
            raise ValueError("quantization='int8' runs on torch's CPU int8 kernels; use device='cpu' "
                             f"(got device {self.device!r})")
        if self.quantization == "int8" and self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"quantization='int8' computes in float32 (the int8 kernels take fp32 activations), "
                             f"or with dtype='bfloat16' runs the encoder in bf16 beside int8 decode; "
                             f"dtype={self.dtype!r} is not supported with it")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {self.kv_cache_dtype!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        if self.dtype == "fastest":
            raise ValueError("dtype='fastest' is resolved by the engine for this machine (LLMEngine)")
        return _DTYPES[self.dtype]

    @property
    def bf16_encoder_int8_decoder(self) -> bool:
        """quantization='int8' with dtype='bfloat16' (compute type int8_bfloat16): the encoder and the cross K/V
        projections in bf16, the decoder's other linears int8 with fp32 activations, the KV pool bf16."""
        return self.quantization == "int8" and self.dtype == "bfloat16"

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        """The KV pool's element type: int8 (values + their scales, packed per row) or the model's dtype
        (a bf16 model on the CPU keeps bf16: its decode reads widen each value to fp32 as they read it)."""
        if self.kv_cache_dtype == "int8":
            return torch.int8
        return self.torch_dtype
