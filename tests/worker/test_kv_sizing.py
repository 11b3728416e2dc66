"""KV pool sizing from (faked) device memory readings, and the start-up report."""

import pytest
import torch

from encdec_engine.models.interface import KVCacheSpec
from encdec_engine.worker.cache_engine import bytes_per_block
from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
from encdec_engine.worker.kv_sizing import (
    KVPoolReport,
    MemoryProfile,
    num_kv_blocks_for_memory,
    profile_forward,
    profile_free_memory,
    size_kv_pool,
)

GiB, MiB = 1 << 30, 1 << 20
WHISPER_TINY = KVCacheSpec(num_layers=4, num_kv_heads=6, head_dim=64)  # d_model 384, 6 heads


def test_blocks_fill_the_share_left_after_weights_and_activations():
    # 80 GiB device, 90% share = 72 GiB; 10 GiB weights, 6 GiB activations -> 56 GiB of 2 MiB blocks.
    blocks = num_kv_blocks_for_memory(free_bytes=79 * GiB, total_bytes=80 * GiB, gpu_memory_utilization=0.9,
                                      model_bytes=10 * GiB, activation_peak_bytes=6 * GiB, bytes_per_block=2 * MiB)
    assert blocks == (int(80 * GiB * 0.9) - 16 * GiB) // (2 * MiB) == 28672


def test_partial_blocks_are_dropped():
    assert num_kv_blocks_for_memory(1000, 1000, 1.0, 100, 50, 100) == 8  # 850 bytes -> 8 whole blocks


def test_the_share_is_per_engine_and_must_be_free():
    """vLLM's rule: gpu_memory_utilization is this engine's share, whatever else holds the device."""
    # Another process holds 40 of 80 GiB: a 90% share cannot be had, and that is an error, not a pool
    # that takes every free byte.
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9 gives this engine 72.00 GiB.*only 30.00 GiB"):
        num_kv_blocks_for_memory(free_bytes=30 * GiB, total_bytes=80 * GiB, gpu_memory_utilization=0.9,
                                 model_bytes=10 * GiB, activation_peak_bytes=6 * GiB, bytes_per_block=2 * MiB)
    # A 40% share fits beside it: 32 GiB - 10 GiB of weights - 6 GiB of activations.
    blocks = num_kv_blocks_for_memory(free_bytes=30 * GiB, total_bytes=80 * GiB, gpu_memory_utilization=0.4,
                                      model_bytes=10 * GiB, activation_peak_bytes=6 * GiB, bytes_per_block=2 * MiB)
    assert blocks == (int(80 * GiB * 0.4) - 16 * GiB) // (2 * MiB)


@pytest.mark.parametrize("util", [0.0, -0.1, 1.01])
def test_utilization_outside_0_1_is_refused(util):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_kv_blocks_for_memory(GiB, GiB, util, 0, 0, MiB)


def test_no_room_for_one_block_is_a_clear_error():
    with pytest.raises(ValueError, match="no room for the KV cache.*raise gpu_memory_utilization"):
        num_kv_blocks_for_memory(free_bytes=8 * GiB, total_bytes=8 * GiB, gpu_memory_utilization=0.5,
                                 model_bytes=3 * GiB, activation_peak_bytes=GiB, bytes_per_block=2 * MiB)


class FakeReader:
    """Device memory as the CUDA caching allocator would report it around a profiling run."""

    def __init__(self, weights: int, activations: int, free: int, total: int, reserved: int) -> None:
        self.allocated, self.peak = weights, weights
        self.activations, self.free, self.total, self.reserved = activations, free, total, reserved
        self.calls: list[str] = []

    def synchronize(self) -> None:
        self.calls.append("sync")

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset")
        self.peak = self.allocated

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def memory_reserved(self) -> int:
        return self.reserved

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, self.total

    def forward(self) -> None:
        self.calls.append("forward")
        self.peak = self.allocated + self.activations  # freed again afterwards, still reserved


def test_profile_measures_weights_activation_peak_and_free_memory():
    reader = FakeReader(weights=10 * GiB, activations=6 * GiB, free=60 * GiB, total=80 * GiB, reserved=17 * GiB)
    profile = profile_free_memory(torch.device("cuda"), reader.forward, reader=reader, model_bytes=10 * GiB)
    assert reader.calls == ["sync", "reset", "forward", "sync"]
    # Free for this engine = device free + what this process's allocator holds unused (17 - 10 GiB).
    assert profile == MemoryProfile(free_bytes=67 * GiB, total_bytes=80 * GiB, model_bytes=10 * GiB,
                                    activation_peak_bytes=6 * GiB)
    blocks = num_kv_blocks_for_memory(profile.free_bytes, profile.total_bytes, 0.9, profile.model_bytes,
                                      profile.activation_peak_bytes, 2 * MiB)
    assert blocks == (int(72 * GiB) - 16 * GiB) // (2 * MiB)


def test_report_states_blocks_tokens_and_whisper_cross_cost():
    per_block = bytes_per_block(WHISPER_TINY, 16, torch.float16)
    assert per_block == 2 * 4 * 16 * 6 * 64 * 2  # K and V, layers, tokens, heads, head_dim, fp16 bytes
    report = KVPoolReport(WHISPER_TINY, block_size=16, dtype=torch.float16, num_blocks=10_000)
    assert report.num_tokens == 160_000 and report.pool_bytes == 10_000 * per_block
    assert report.cross_blocks() == 94  # ceil(1500 / 16)
    text = report.describe()
    assert "10000 blocks x 16 tokens = 160000 token slots, 937.50 MiB" in text
    assert "4 layers x 6 KV heads x head_dim 64, float16, 96.00 KiB/block" in text
    assert "cross cache (1500 positions) takes 94 blocks (8.81 MiB)" in text
    assert "at most 106 such requests at once" in text
    assert "gpu_memory_utilization" not in text  # not profiled: no sizing line


def test_report_of_other_encoders_and_decoder_only_models():
    bart = KVPoolReport(KVCacheSpec(12, 16, 64), 16, torch.float16, 5000, cross_positions=1024)
    assert "a full-length request's cross cache (1024 positions) takes 64 blocks" in bart.describe()
    decoder_only = KVPoolReport(KVCacheSpec(12, 16, 64), 16, torch.float16, 5000, cross_positions=None)
    assert "cross" not in decoder_only.describe() and len(decoder_only.describe().splitlines()) == 1


def test_report_explains_a_profiled_size():
    memory = MemoryProfile(free_bytes=77 * GiB, total_bytes=80 * GiB, model_bytes=GiB // 2,
                           activation_peak_bytes=3 * GiB)
    report = KVPoolReport(WHISPER_TINY, 16, torch.bfloat16, 1000, memory=memory, gpu_memory_utilization=0.9)
    line = report.describe().splitlines()[-1]
    assert line == ("sized for gpu_memory_utilization=0.9 of 80.00 GiB (77.00 GiB free): weights 0.50 GiB, "
                    "activation peak 3.00 GiB")


# -- putting it together ---------------------------------------------------------------
def pool(device: str, **kw) -> KVPoolReport:
    args = dict(num_kv_blocks=None, kv_cache_space_gb=None, gpu_memory_utilization=0.9, cross_positions=1500)
    args.update(kw)
    return size_kv_pool(WHISPER_TINY, 16, torch.float16, torch.device(device), **args)


def test_configured_sizes_win_and_cpu_defaults_to_2_gib():
    never = dict(run_profile_forward=lambda: pytest.fail("nothing to profile"))
    assert pool("cuda", num_kv_blocks=123, **never).num_blocks == 123
    per_block = bytes_per_block(WHISPER_TINY, 16, torch.float16)
    assert pool("cuda", kv_cache_space_gb=1.0, **never).num_blocks == GiB // per_block
    cpu = pool("cpu", **never)
    assert cpu.num_blocks == 2 * GiB // per_block and cpu.memory is None


def test_cuda_without_a_size_profiles_one_step():
    reader = FakeReader(weights=GiB, activations=2 * GiB, free=70 * GiB, total=80 * GiB, reserved=3 * GiB)
    report = pool("cuda", run_profile_forward=reader.forward, reader=reader, model_bytes=GiB)  # fake: no CUDA
    per_block = bytes_per_block(WHISPER_TINY, 16, torch.float16)
    assert report.num_blocks == (int(80 * GiB * 0.9) - 3 * GiB) // per_block
    assert report.memory.activation_peak_bytes == 2 * GiB and "gpu_memory_utilization=0.9" in report.describe()


class SpyBackend(TorchSDPABackend):
    def __init__(self) -> None:
        super().__init__(16)
        self.planned = []

    def plan(self, metadata) -> None:
        self.planned.append({name: (v.num_seqs, v.key_lens_list[0]) for name, v in
                             (("decoder", metadata.decoder), ("encoder", metadata.encoder),
                              ("cross", metadata.cross)) if v is not None})
        super().plan(metadata)


@pytest.mark.parametrize("kind", ["bart", "whisper", "gpt2", "llama_gqa"])
def test_profile_forward_runs_the_largest_step(kind):
    from transformers import BartConfig, GPT2Config, LlamaConfig, WhisperConfig

    from encdec_engine.models.registry import resolve_model_class

    small = dict(vocab_size=300, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    config = {
        "bart": BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                           max_position_embeddings=100, decoder_start_token_id=2, **small),
        "whisper": WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                 num_mel_bins=8, max_source_positions=30, max_target_positions=40,
                                 decoder_start_token_id=3, **small),
        "gpt2": GPT2Config(n_embd=32, n_head=2, n_layer=1, n_positions=64, **small),
        "llama_gqa": LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                                 intermediate_size=64, max_position_embeddings=64, **small),
    }[kind]
    backend = SpyBackend()
    model = resolve_model_class(config)(config, backend).eval()
    profile_forward(model, backend, 16, torch.device("cpu"), max_num_batched_tokens=250, max_num_seqs=8,
                    max_decoder_len=64)
    expected = {
        "bart": {"decoder": (2, 1), "encoder": (2, 100), "cross": (2, 100)},  # 250 // (100 + 1) requests
        "whisper": {"decoder": (8, 1), "encoder": (8, 30), "cross": (8, 30)},  # capped by max_num_seqs
        "gpt2": {"decoder": (3, 64)},  # 250 // 64 full-length prompts
        "llama_gqa": {"decoder": (3, 64)},
    }[kind]
    assert backend.planned == [expected]


def test_a_second_engine_does_not_count_the_first_as_its_weights():
    """Another engine of this process holds 30 GiB: the second one's own weights are 1 GiB."""
    reader = FakeReader(weights=31 * GiB, activations=2 * GiB, free=40 * GiB, total=80 * GiB, reserved=32 * GiB)
    report = pool("cuda", run_profile_forward=reader.forward, reader=reader, gpu_memory_utilization=0.4,
                  model_bytes=GiB)
    per_block = bytes_per_block(WHISPER_TINY, 16, torch.float16)
    assert report.memory.free_bytes == 41 * GiB and report.memory.model_bytes == GiB
    assert report.num_blocks == (int(80 * GiB * 0.4) - 3 * GiB) // per_block


def test_weight_bytes_counts_tied_tensors_once():
    from encdec_engine.worker.kv_sizing import weight_bytes

    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    model.register_buffer("scale", torch.ones(3, dtype=torch.float16))
    assert weight_bytes(model) == 10 * 4 * 4 + 3 * 2


def test_the_engine_logs_each_line_of_its_kv_pool_as_a_record(bart_path, caplog):
    """The report's lines were one record, so a handler's prefix (the server's "INFO:     ") stood before
    the first only and "a full-length request's cross cache ..." came bare; each is a record now."""
    from encdec_engine import LLM

    with caplog.at_level("INFO", logger="encdec_engine"):
        llm = LLM(model=str(bart_path), num_kv_blocks=64)
    messages = [r.getMessage() for r in caplog.records if r.name == "encdec_engine.engine.llm_engine"]
    assert all("\n" not in m for m in messages), messages
    assert any(m.startswith("KV pool: 64 blocks") for m in messages), messages
    assert any(m.startswith("a full-length request's cross cache") for m in messages), messages
    del llm
