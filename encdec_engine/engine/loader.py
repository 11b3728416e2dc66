"""Loading a checkpoint: config, tokenizer, generation config, weights, attention backend."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
from encdec_engine.config import EngineConfig
from encdec_engine.attention.ops import cpu_decode
from encdec_engine.machine.cpu_kernels import machine_plan, prepare_cpu_linears
from encdec_engine.layers.linear import bf16_native
from encdec_engine.models.registry import resolve_model_class
from encdec_engine.attention.metadata import AttentionType
from encdec_engine.models.encdec_layers import EncDecAttention
from encdec_engine.checkpoints.generation_config import decoder_start_token_id, load_generation_config
from encdec_engine.checkpoints.model_config import read_whisper_config
from encdec_engine.checkpoints.names import resolve
from encdec_engine.checkpoints.tokenizer_files import load_tokenizer, tokenizer_if_any
from encdec_engine.checkpoints.weights import iter_checkpoint, weight_files
from encdec_engine.checkpoints.whisper.vocab import add_timestamp_tokens, complete_whisper_generation_config

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

    from encdec_engine.attention.backends.base import AttentionBackend
    from encdec_engine.models.interface import Model

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Model  # an nn.Module of models/ (registry.py)
    tokenizer: PreTrainedTokenizerBase | None  # None: skip_tokenizer_init, or a checkpoint without one
    hf_config: PretrainedConfig
    generation_config: GenerationConfig
    backend: AttentionBackend
    vocab_size: int  # the decoder's: its head's rows (Marian's decoder_vocab_size may be fewer than the encoder's)
    encoder_vocab_size: int
    max_decoder_len: int
    max_encoder_len: int
    decoder_start_token_id: int | None
    default_decoder_prompt: list[int] | None
    eos_token_id: int | None  # the tokenizer's EOS (dropped from decoder text prompts)
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (HF: the generation config's list)
    decoder_prompt_starts: tuple[int, ...] = ()


def resolve_model_path(model: str) -> Path:
    """The checkpoint folder `model` names: a folder (a CTranslate2 one imported into the engine's cache),
    a short name or a hub id, downloaded when it is not on this machine (unless $HF_HUB_OFFLINE)."""
    return resolve(model)


def make_backend(config: EngineConfig, device: torch.device):
    name = config.attention_backend
    if name == "xformers" or (name == "auto" and device.type == "cuda"):
        try:
            from encdec_engine.attention.backends.xformers_backend import XFormersBackend  # lazy: the gpu extra

            backend = XFormersBackend(config.block_size)
            logger.info("attention backend: xformers (flash prefill, Triton paged decode and KV store)")
            return backend
        except ImportError as e:  # also BackendUnavailableError: no CUDA device, no xformers/triton
            if name == "xformers":
                raise ValueError(f"attention_backend='xformers' is unavailable: {e}") from e
            logger.warning("xformers backend unavailable (%s); using the torch backend", e)
    return TorchSDPABackend(config.block_size)


# The torch.nn.init functions module constructors call (reset_parameters).
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "xavier_uniform_",
                   "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextmanager
def _without_init():
    """Module constructors leave their parameters as allocated: the checkpoint overwrites them all."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}
    for name in saved:
        setattr(nn.init, name, _keep)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def read_model_config(path: Path):
    """The checkpoint's config: Whisper's read directly (checkpoints/model_config.py), others by `AutoConfig`."""
    config = read_whisper_config(path)
    if config is not None:
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def encoder_in_bf16(model: nn.Module, config: EngineConfig) -> list[nn.Module]:
    """The parts compute type int8_bfloat16 runs in bf16, turned bf16: the encoder and the decoder's cross-
    attention K/V projections (once a window over all its positions, as the encoder's products are); the rest
    of the decoder stays fp32 for the int8 linears. Only a model whose encoder shares no weight with the rest
    (`encoder_runs_apart`: Whisper) can be split so."""
    name = type(model).__name__
    if not getattr(model, "encoder_runs_apart", False):
        has = "an encoder that shares weights with its decoder" if model.is_encoder_decoder else "no encoder"
        raise ValueError(f"{config.model}: compute type int8_bfloat16 (quantization='int8', dtype='bfloat16') runs "
                         f"an encoder in bf16 beside an int8 decoder; {name} has {has}: use compute type int8 or "
                         f"bfloat16")
    encoder = model.encoder
    rest = {id(p) for n, p in model.named_parameters() if not n.startswith("encoder.")}
    assert not any(id(p) in rest for p in encoder.parameters()), f"{name}'s encoder shares weights with its decoder"
    cross_kv = [m.kv_proj for m in model.decoder.modules()
                if isinstance(m, EncDecAttention) and m.attn_type == AttentionType.ENCODER_DECODER]
    return [part.to(torch.bfloat16) for part in (encoder, *cross_kv)]


def warn_emulated_bf16(config: EngineConfig) -> None:
    """bf16 asked for on a CPU that only emulates it: honoured (a user may want bf16's numbers), said aloud."""
    what = "compute type int8_bfloat16" if config.bf16_encoder_int8_decoder else "dtype bfloat16"
    logger.warning("%s on a CPU without native bf16 (no AVX-512 BF16 or AMX): bf16 is emulated here, several "
                   "times slower than float32; compute type 'auto' picks this machine's "
                   "fastest floating type, 'int8' its fastest type", what)


def load_model(config: EngineConfig) -> LoadedModel:
    path = resolve_model_path(config.model)
    hf_config = read_model_config(path)
    tokenizer_path = resolve_model_path(config.tokenizer) if config.tokenizer else path
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(tokenizer_path)
    generation_config = load_generation_config(path, hf_config)
    if getattr(hf_config, "model_type", None) == "whisper":
        # Without a tokenizer of its own the engine still reads the folder's vocabulary here.
        complete_whisper_generation_config(generation_config, hf_config, tokenizer or tokenizer_if_any(tokenizer_path),
                                           str(path))
        add_timestamp_tokens(tokenizer, generation_config.no_timestamps_token_id + 1, hf_config.vocab_size,
                             str(tokenizer_path))

    device, dtype = config.torch_device, config.torch_dtype
    if device.type == "cpu" and dtype == torch.bfloat16 and not bf16_native():
        warn_emulated_bf16(config)
    backend = make_backend(config, device)
    cls = resolve_model_class(hf_config)
    # Build without initializing weights (every parameter is overwritten by the checkpoint; one it lacks
    # fails the load). Allocated on the CPU, not on the meta device: each meta op runs torch's Python
    # reference kernels, which import torch._dynamo and sympy (~2 s of every start-up).
    with _without_init():
        model = cls(hf_config, backend)
    for buf in model.buffers():
        buf.zero_()
    files = weight_files(path)
    try:
        model.load_weights(iter_checkpoint(path, files))
    except ValueError as e:  # a tensor of the wrong shape, one missing or left over
        raise ValueError(f"{path}: the weights ({', '.join(f.name for f in files)}) do not fit config.json: {e}") from e
    mixed = config.bf16_encoder_int8_decoder
    model = model.to(device=device, dtype=torch.float32 if mixed else dtype).eval()
    bf16_parts = encoder_in_bf16(model, config) if mixed else ()
    for module in model.modules():
        if isinstance(module, EncDecAttention):
            module.fold_query_scaling()
    plan = prepare_cpu_linears(model, config.quantization, bf16_parts)  # this machine's fp32, bf16 or int8 kernels
    if plan is not None and hasattr(backend, "onednn_attention") and (plan.bf16 or machine_plan(int8=False).fp32
                                                                      == "onednn"):
        # Long prefill attention on the linears' library; in bf16 where the model is bf16 or int8 weights
        # already trade exactness, and oneDNN multiplies bf16 natively.
        bf16 = (plan.bf16 or config.quantization == "int8") and bf16_native()
        backend.onednn_attention = torch.bfloat16 if bf16 else torch.float32
        backend.amx_flash = bf16 and torch.cpu._is_amx_tile_supported()  # torch's flash kernel on the AMX tiles
    pool_dtype = config.torch_kv_cache_dtype
    if hasattr(backend, "fused_decode") and device.type == "cpu" and pool_dtype in cpu_decode.POOL_DTYPES:
        backend.fused_decode = cpu_decode.load()  # decode reads straight from the pool, where it builds

    eos = hf_config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    stop = getattr(generation_config, "eos_token_id", None)
    stop = stop if stop is not None else hf_config.eos_token_id
    stop = tuple(stop) if isinstance(stop, (list, tuple)) else (() if stop is None else (stop,))
    return LoadedModel(
        model=model, tokenizer=tokenizer, hf_config=hf_config, generation_config=generation_config,
        backend=backend, vocab_size=getattr(model, "head_vocab_size", lambda c: c.vocab_size)(hf_config),
        encoder_vocab_size=hf_config.vocab_size, max_decoder_len=model.max_decoder_len,
        max_encoder_len=model.max_encoder_len,
        decoder_start_token_id=(decoder_start_token_id(hf_config, generation_config) if model.is_encoder_decoder
                                else None),
        default_decoder_prompt=model.default_decoder_prompt(generation_config) if model.is_encoder_decoder else None,
        eos_token_id=eos,
        eos_token_ids=stop,
        decoder_prompt_starts=tuple(t for t in [getattr(generation_config, "prev_sot_token_id", None)] if t is not None),
    )
