"""On a CUDA device: parity with HF, and the xformers backend (flash prefill, compiled Triton
kernels) against the torch backend on the same inputs. Skipped cleanly without CUDA.

Deselected by the default `-m 'not slow and not gpu'`; run with `pytest -m gpu tests/worker/test_gpu.py`.
"""

import logging

import numpy as np
import pytest
import torch
from helpers import mixed_prompts

from encdec_engine import SamplingParams
from encdec_engine.attention.backends.base import store_kv
from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
from encdec_engine.attention.metadata import AttentionMetadata, AttentionView
from encdec_engine.worker.input_prep import pad_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 parity means fp32: no TF32 in matmuls or convolutions (HF and the engine alike)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def hf_greedy_cuda(model, encoder_ids: list[int], decoder_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([encoder_ids], device=CUDA),
                             decoder_input_ids=torch.tensor([decoder_ids], device=CUDA),
                             attention_mask=torch.ones(1, len(encoder_ids), dtype=torch.long, device=CUDA),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, forced_eos_token_id=None,
                             forced_bos_token_id=None, min_length=0, no_repeat_ngram_size=0, repetition_penalty=1.0)
    return out[0, len(decoder_ids):].tolist()


# -- end to end ----------------------------------------------------------------------
@pytest.mark.parametrize("config", ["small", "odd_heads"])  # odd_heads: head_dim 12 -> flash refuses, torch serves
def test_bart_greedy_matches_hf_on_cuda_fp32(config, bart_paths, make_llm):
    from transformers import BartForConditionalGeneration

    llm = make_llm(bart_paths[config], device="cuda", dtype="float32", num_kv_blocks=400)
    assert llm.engine.runner.backend.name == "xformers"
    prompts = mixed_prompts(llm.get_tokenizer(), n=14, seed=3)
    max_tokens = [3 + (7 * i) % 29 for i in range(len(prompts))]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens], use_tqdm=False)
    hf = BartForConditionalGeneration.from_pretrained(bart_paths[config]).to(CUDA).eval()
    ref = [hf_greedy_cuda(hf, o.encoder_prompt_token_ids, o.prompt_token_ids, m) for o, m in zip(outs, max_tokens)]
    mismatches = [i for i, (o, r) in enumerate(zip(outs, ref)) if o.outputs[0].token_ids != r]
    assert not mismatches, f"{len(mismatches)}/{len(outs)} differ from HF: {mismatches}"
    assert llm.engine.runner.graph_steps > 0  # decode replayed CUDA graphs


def test_cuda_graph_decode_equals_eager_decode(bart_path, make_llm):
    prompts = None
    tokens = {}
    for eager in (False, True):
        llm = make_llm(bart_path, device="cuda", dtype="float32", num_kv_blocks=400, enforce_eager=eager)
        prompts = prompts or mixed_prompts(llm.get_tokenizer(), n=20, seed=8)
        params = [SamplingParams(temperature=0.0, max_tokens=4 + (5 * i) % 23) for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in outs]
        runner = llm.engine.runner
        assert (runner.graphs is None) == eager and (runner.graph_steps == 0) == eager
    assert tokens[False] == tokens[True]


def test_bart_bf16_first_tokens_agree_with_hf_bf16(bart_path, make_llm):
    from transformers import BartForConditionalGeneration

    llm = make_llm(bart_path, device="cuda", dtype="bfloat16", num_kv_blocks=400)
    prompts = mixed_prompts(llm.get_tokenizer(), n=12, seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    hf = BartForConditionalGeneration.from_pretrained(bart_path, dtype=torch.bfloat16).to(CUDA).eval()
    agree = sum(o.outputs[0].token_ids[0] == hf_greedy_cuda(hf, o.encoder_prompt_token_ids, o.prompt_token_ids, 1)[0]
                for o in outs)
    assert agree >= 10, f"bf16 first tokens agree on only {agree}/12"


@pytest.fixture(scope="module")
def whisper_clips():
    from helpers import AUDIO, SHORT_CLIPS

    from encdec_engine.inputs.audio import load_audio
    from encdec_engine.inputs.features import log_mel_spectrogram

    files = [AUDIO / n for n in SHORT_CLIPS]
    return files, log_mel_spectrogram([load_audio(f) for f in files])


@pytest.fixture(scope="module")
def hf_tiny_en_cuda():
    from transformers import WhisperForConditionalGeneration

    from encdec_engine.checkpoints.ct2.importer import default_model_path

    return WhisperForConditionalGeneration.from_pretrained(default_model_path()).to(CUDA).eval()


def hf_whisper_tokens(model, features) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(input_features=f[None].to(CUDA, model.dtype), return_dict_in_generate=True)
                .sequences[0].tolist() for f in features]


def test_whisper_tiny_en_matches_hf_on_cuda_fp32(make_llm, whisper_clips, hf_tiny_en_cuda):
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    llm = make_llm(default_model_path(), device="cuda", dtype="float32", gpu_memory_utilization=0.4)
    files, features = whisper_clips
    results = llm.transcribe(files, timestamps=False, temperatures=(0.0,))
    prompt = llm.engine.input_processor.default_decoder_prompt
    for f, result, ref in zip(files, results, hf_whisper_tokens(hf_tiny_en_cuda, features)):
        assert result.error is None and len(result.segments) == 1
        assert prompt + result.segments[0].tokens + [50256] == ref, f.name
    assert llm.engine.runner.graph_steps > 0


def test_whisper_tiny_en_bf16_first_token_agrees(make_llm, whisper_clips, hf_tiny_en_cuda):
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    llm = make_llm(default_model_path(), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.4)
    files, features = whisper_clips
    results = llm.transcribe(files, timestamps=False, temperatures=(0.0,))
    refs = hf_whisper_tokens(hf_tiny_en_cuda, features)  # fp32 reference
    prompt_len = len(llm.engine.input_processor.default_decoder_prompt)
    first = [(r.segments[0].tokens[:1], ref[prompt_len : prompt_len + 1]) for r, ref in zip(results, refs)]
    assert all(mine == theirs for mine, theirs in first), first


# -- the backend against the torch backend, same CUDA inputs ------------------------
def make_view(q_lens, k_lens, causal, **kw) -> AttentionView:
    q_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    k_start = kw.pop("key_start_loc", None)
    return AttentionView(
        query_start_loc=torch.from_numpy(q_loc).to(CUDA), key_lens=torch.tensor(k_lens, device=CUDA), causal=causal,
        max_query_len=max(q_lens), max_key_len=max(k_lens), query_start_loc_list=q_loc.tolist(),
        key_lens_list=list(k_lens), key_start_loc=None if k_start is None else torch.tensor(k_start, device=CUDA),
        key_start_loc_list=k_start, **{name: t.to(CUDA) for name, t in kw.items()},
    )


def both(view_args, q, k, v, caches, scale, block_size):
    """Run the same step through the xformers and the torch backend (each on its own cache copy)."""
    from encdec_engine.attention.backends.xformers_backend import XFormersBackend

    outs = []
    for backend, cache in zip((XFormersBackend(block_size), TorchSDPABackend(block_size)), caches):
        view = make_view(*view_args[:3], **view_args[3])
        backend.plan(AttentionMetadata(decoder=view, block_size=block_size))
        outs.append(backend.forward(q, k, v, cache, view, scale))
    return outs


def paged_cache(k_lens, num_kv_heads, head_dim, block_size, dtype, seed):
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-n // block_size) for n in k_lens) + 2
    cache = torch.randn(2, num_blocks + 1, block_size, num_kv_heads, head_dim, device=CUDA).to(dtype)
    free = list(rng.permutation(np.arange(1, num_blocks + 1)))
    tables = [[int(free.pop()) for _ in range(-(-n // block_size))] for n in k_lens]
    return cache, torch.from_numpy(pad_rows(tables))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 6, 64), (8, 2, 128)])
def test_xformers_backend_matches_torch_backend(dtype, num_heads, num_kv_heads, head_dim, caplog):
    torch.manual_seed(0)
    bs, scale = 16, head_dim**-0.5
    tol = TOLERANCE[dtype]

    def rand(*shape):
        return torch.randn(*shape, device=CUDA).to(dtype)

    # Fresh prefill: encoder (non-causal), decoder (causal), cross (rectangular), cross with a shared segment.
    q_lens, e_lens = [3, 40, 1, 17], [1500, 7, 33, 1]
    cases = {
        "encoder": (e_lens, e_lens, False, np.cumsum([0] + e_lens[:-1]).tolist()),
        "decoder": (q_lens, q_lens, True, np.cumsum([0] + q_lens[:-1]).tolist()),
        "cross": (q_lens, e_lens, False, np.cumsum([0] + e_lens[:-1]).tolist()),
        "cross_shared": (q_lens, [1500, 1500, 33, 1], False, [0, 0, 1507, 1540]),
    }
    for name, (ql, kl, causal, k_start) in cases.items():
        num_k = max(s + n for s, n in zip(k_start, kl))
        q, k, v = rand(sum(ql), num_heads, head_dim), rand(num_k, num_kv_heads, head_dim), rand(
            num_k, num_kv_heads, head_dim)
        with caplog.at_level(logging.WARNING):
            mine, ref = both((ql, kl, causal, {"key_start_loc": k_start}), q, k, v, [None, None], scale, bs)
        torch.testing.assert_close(mine, ref, **tol, msg=name)

    # Decode over paged self and cross caches (1500 keys: split-K partitions), KV store of the new token.
    k_lens = [1, 17, 448, 1500]
    cache, tables = paged_cache(k_lens, num_kv_heads, head_dim, bs, dtype, seed=1)
    caches = [cache, cache.clone()]
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(k_lens)])
    q, k, v = rand(4, num_heads, head_dim), rand(4, num_kv_heads, head_dim), rand(4, num_kv_heads, head_dim)
    mine, ref = both(([1] * 4, k_lens, True, {"block_tables": tables, "slot_mapping": slots}), q, k, v, caches,
                     scale, bs)
    assert torch.equal(caches[0], caches[1]), "KV store differs"
    torch.testing.assert_close(mine, ref, **tol)

    # Prefill over a cached prefix (bottom-right causal over keys read from the cache).
    q_lens, k_lens = [5, 1, 30], [21, 1, 64]
    cache, tables = paged_cache(k_lens, num_kv_heads, head_dim, bs, dtype, seed=2)
    q = rand(sum(q_lens), num_heads, head_dim)
    mine, ref = both((q_lens, k_lens, True, {"block_tables": tables}), q, None, None, [cache, cache], scale, bs)
    torch.testing.assert_close(mine, ref, **tol)
    if dtype == torch.float32:  # flash has no fp32: the fallback says so
        assert any("using torch SDPA" in r.getMessage() for r in caplog.records)


# -- the compiled kernels against the references -------------------------------------
@pytest.fixture(scope="module")
def compiled_ops():
    from encdec_engine.attention.ops import kv_store, paged_attention

    if paged_attention.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set: these tests are for the compiled kernels")
    return kv_store, paged_attention


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("partition_size", [None, 64, -1])
def test_compiled_paged_decode_matches_naive(compiled_ops, dtype, partition_size):
    _, paged_attention = compiled_ops
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, bs = 12, 4, 80, 16
    k_lens = [1, 15, 16, 17, 300, 1500]
    cache, tables = paged_cache(k_lens, num_kv_heads, head_dim, bs, dtype, seed=3)
    q = torch.randn(len(k_lens), num_heads, head_dim, device=CUDA).to(dtype)
    out = paged_attention.paged_decode_attention(q, cache, tables.to(CUDA), torch.tensor(k_lens, device=CUDA),
                                                 head_dim**-0.5, bs, partition_size=partition_size)
    for i, n in enumerate(k_lens):
        pos = torch.arange(n, device=CUDA)
        slot = tables.to(CUDA)[i, pos // bs] * bs + pos % bs
        k = cache[0].view(-1, num_kv_heads, head_dim)[slot].double().repeat_interleave(3, 1)
        v = cache[1].view(-1, num_kv_heads, head_dim)[slot].double().repeat_interleave(3, 1)
        p = (torch.einsum("hd,khd->hk", q[i].double(), k) * head_dim**-0.5).softmax(-1)
        torch.testing.assert_close(out[i].double(), torch.einsum("hk,khd->hd", p, v), **TOLERANCE[dtype])


def test_compiled_store_kv_matches_reference(compiled_ops):
    kv_store, _ = compiled_ops
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        key, value = torch.randn(300, 6, 64, device=CUDA), torch.randn(300, 6, 64, device=CUDA)
        slots = torch.randperm(64 * 16, device=CUDA)[:300] + 16
        slots[::7] = -1  # padding tokens: skipped
        got = torch.zeros(2, 65, 16, 6, 64, device=CUDA, dtype=dtype)
        expected = got.clone()
        kv_store.store_kv_triton(key, value, got, slots)
        keep = slots >= 0
        store_kv(key[keep], value[keep], expected, slots[keep])
        assert torch.equal(got, expected), dtype


def test_profile_free_memory_on_cuda():
    from encdec_engine.worker.kv_sizing import num_kv_blocks_for_memory, profile_free_memory

    def forward():
        x = torch.empty(256 << 20, dtype=torch.uint8, device=CUDA)  # 256 MiB of "activations"
        del x

    profile = profile_free_memory(CUDA, forward, model_bytes=0)
    assert profile.activation_peak_bytes >= 256 << 20
    assert 0 < profile.free_bytes <= profile.total_bytes
    half_of_free = profile.free_bytes / profile.total_bytes / 2  # other tests' engines may hold the rest
    assert num_kv_blocks_for_memory(profile.free_bytes, profile.total_bytes, half_of_free, 0,
                                    profile.activation_peak_bytes, 1 << 20) > 0
