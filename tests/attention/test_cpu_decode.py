"""The compiled decode-attention kernel (attention/ops/cpu_decode.py): against naive attention over a paged
pool, through the backend against its copies, in the engine, and how it is built, kept and refused."""

import ctypes
import logging
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import make_view, mixed_prompts, naive_attention

from encdec_engine import SamplingParams
from encdec_engine.attention.backends.torch_sdpa import PagedDecodePlan, TorchSDPABackend
from encdec_engine.attention.metadata import AttentionMetadata
from encdec_engine.attention.ops import cpu_decode
from encdec_engine.attention.position_bias import alibi_bias, alibi_slopes, t5_bucket_index, t5_position_bias
from encdec_engine.worker.input_prep import pad_rows

KERNEL = cpu_decode.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the decode kernel does not build here (see the log)")


def test_the_kernel_builds_where_there_is_a_compiler():
    """CI machines have gcc: a kernel that stops building must fail here, not fall back unseen."""
    if not sys.platform.startswith("linux") or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    assert KERNEL is not None


def pool(lens, num_kv_heads, dim, block_size, rng, width=None, dtype=torch.float32):
    """Contexts stored at shuffled blocks of a pool [2, blocks, block_size, Hkv, width] of `dtype`; returns
    the pool, int64 tables, and each context's keys and values (fp32, as stored)."""
    width = width or dim
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, width).to(dtype)  # garbage everywhere else
    free = list(rng.permutation(num_blocks))
    tables, ks, vs = [], [], []
    for n in lens:
        table = [int(free.pop()) for _ in range(-(-n // block_size))]
        k, v = (torch.randn(n, num_kv_heads, dim).to(dtype).float() for _ in range(2))
        pos = np.arange(n)
        slots = torch.tensor(np.array(table)[pos // block_size] * block_size + pos % block_size)
        cache[0].view(-1, num_kv_heads, width)[slots, :, :dim] = k.to(dtype)
        cache[1].view(-1, num_kv_heads, width)[slots, :, :dim] = v.to(dtype)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    return cache, torch.from_numpy(pad_rows(tables)), ks, vs


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,lens,width", [
    (4, 4, 8, 4, [1, 9, 4, 17], None),  # few sequences: tasks are chunks of a sequence's heads
    (8, 2, 24, 16, [3, 40, 1, 33, 16, 17], None),  # grouped queries
    (4, 1, 16, 1, [5, 2, 11], None),  # one kv head; one position a block
    (3, 3, 12, 8, [7, 1, 30], 15),  # odd heads; rows wider than the head (an int8-sized row's room)
    (6, 6, 64, 16, [1 + (7 * i) % 61 for i in range(40)], None),  # many sequences: one task each
])
@pytest.mark.parametrize("dtype", cpu_decode.POOL_DTYPES)
def test_kernel_matches_naive_attention(heads, kv_heads, dim, block_size, lens, width, dtype):
    torch.manual_seed(0)
    cache, tables, ks, vs = pool(lens, kv_heads, dim, block_size, np.random.default_rng(0), width, dtype)
    query = torch.randn(len(lens), heads, dim)
    bias = torch.randn(len(lens), heads, max(lens))
    for mask in (None, bias):
        out = KERNEL.attend(query, cache, tables, torch.tensor(lens), max(lens), mask)
        for i, n in enumerate(lens):
            ref = naive_attention(query[i : i + 1], ks[i], vs[i], 1.0, None if mask is None else mask[i, :, None, :n])
            torch.testing.assert_close(out[i : i + 1].double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dim", [64, 24, 80])
def test_a_bf16_pool_reads_to_the_bits_of_an_fp32_pool_of_the_same_values(dim):
    """The kernel widens bf16 as it reads and sums in a fixed order: a bf16 model's transcripts do not move
    with the pool's type."""
    lens = [1500, 37, 5, 160]
    cache, tables, _, _ = pool(lens, 6, dim, 16, np.random.default_rng(4), dtype=torch.bfloat16)
    query = torch.randn(len(lens), 6, dim)
    bf16 = KERNEL.attend(query, cache, tables, torch.tensor(lens), max(lens))
    assert torch.equal(bf16, KERNEL.attend(query, cache.float(), tables, torch.tensor(lens), max(lens)))


@needs_kernel
def test_kernel_reads_strided_queries_and_refuses_what_it_cannot_read():
    torch.manual_seed(1)
    cache, tables, ks, vs = pool([6, 3], 2, 8, 4, np.random.default_rng(1))
    qkv = torch.randn(2, 3 * 2 * 8)  # a fused projection's output: the queries are a strided view
    query = qkv[:, :16].view(2, 2, 8)
    out = KERNEL.attend(query, cache, tables, torch.tensor([6, 3]), 6)
    torch.testing.assert_close(out, KERNEL.attend(query.contiguous(), cache, tables, torch.tensor([6, 3]), 6))
    with pytest.raises(ValueError, match="unsupported operands"):
        KERNEL.attend(query, cache.to(torch.int8), tables, torch.tensor([6, 3]), 6)
    with pytest.raises(ValueError, match="unsupported operands"):
        KERNEL.attend(query, cache.half(), tables, torch.tensor([6, 3]), 6)
    with pytest.raises(ValueError, match="unsupported operands"):  # longer than the tables reach
        KERNEL.attend(query, cache, tables, torch.tensor([6, 9]), 9)
    with pytest.raises(ValueError, match="outside the pool"):  # a block id past the pool's end
        KERNEL.attend(query, cache, tables + cache.shape[1], torch.tensor([6, 3]), 6)
    with pytest.raises(ValueError, match="outside the pool"):  # a length past the reads' extent
        KERNEL.attend(query, cache, tables, torch.tensor([7, 3]), 6)


def test_a_steps_plan_checks_its_indices_once_per_pool_and_still_refuses_bad_ones(monkeypatch):
    """The layers of a step share its tables and lengths: the bounds check runs for the first layer reading
    a pool of a given size, not at every layer, and a plan naming a block past the pool still raises."""
    calls = []
    check = cpu_decode.check_indices
    monkeypatch.setattr(cpu_decode, "check_indices", lambda *a: calls.append(a[-1]) or check(*a))
    plan = PagedDecodePlan(torch.tensor([[0, 2], [1, 0]]), torch.tensor([5, 3]), 5)
    for _ in range(4):  # four layers over a pool of 3 blocks
        plan.check_indices(3)
    assert calls == [3]
    with pytest.raises(ValueError, match="outside the pool"):  # a smaller pool: checked anew, and refused
        plan.check_indices(2)
    with pytest.raises(ValueError, match=r"lengths 0\.\.3"):
        PagedDecodePlan(torch.tensor([[0]]), torch.tensor([0, 3]), 3).check_indices(4)


@needs_kernel
@pytest.mark.parametrize("bias_kind", [None, "t5", "alibi"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", cpu_decode.POOL_DTYPES)
def test_backend_reads_decode_steps_through_the_kernel_as_through_its_copies(causal, bias_kind, dtype):
    torch.manual_seed(2)
    heads, dim, block_size, lens = 4, 8, 4, [1, 9, 4, 17, 12]
    cache, tables, ks, vs = pool(lens, heads, dim, block_size, np.random.default_rng(2), dtype=dtype)
    bias = {None: None, "alibi": alibi_bias(alibi_slopes(heads), 32),
            "t5": t5_position_bias(torch.randn(8, heads), *t5_bucket_index(False, 8, 16))}[bias_kind]
    outs = {}
    for fused in (KERNEL, None):
        backend = TorchSDPABackend(block_size)
        backend.fused_decode = fused
        view = make_view([1] * len(lens), lens, causal, block_tables=tables)
        view.seq_ids = list(range(len(lens))) if causal else None  # the copies' self rows are kept per sequence
        backend.plan(AttentionMetadata(decoder=view) if causal else AttentionMetadata(decoder=None, cross=view))
        assert isinstance(view.plan, PagedDecodePlan) == (fused is not None)
        query = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(3))
        outs[fused is not None] = backend.forward(query, None, None, cache, view, dim**-0.5, bias)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    for i, n in enumerate(lens):  # and both are the textbook's
        mask = None if bias is None else bias.block(1, n)  # [H, 1, n]: the query sits at the last key
        ref = naive_attention(query[i : i + 1], ks[i], vs[i], dim**-0.5, mask)
        torch.testing.assert_close(outs[True][i : i + 1].double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_prefill_step_keeps_the_backends_other_plans():
    """Several queries per sequence (a decoder prompt over the cross cache) are not the kernel's."""
    backend = TorchSDPABackend(4)
    backend.fused_decode = KERNEL
    view = make_view([2, 1], [5, 3], False, block_tables=torch.tensor([[0, 1], [2, 0]]))
    backend.plan(AttentionMetadata(decoder=None, cross=view))
    assert not isinstance(view.plan, PagedDecodePlan)


@needs_kernel
@pytest.mark.parametrize("arch,name", [("t5", "small"), ("marian", "small")])
def test_the_engine_decodes_alike_through_the_kernel_and_the_copies(arch, name, text_model, make_llm, monkeypatch):
    """T5 (a position bias in its self reads) and Marian token for token the same both ways (the parity
    tests hold the kernel's to HF's)."""
    llm = make_llm(text_model(arch, name), num_kv_blocks=500)
    backend = llm.engine.runner.backend
    assert backend.fused_decode is not None
    prompts = mixed_prompts(llm.get_tokenizer(), n=10, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + (5 * i) % 17, truncate_prompt_tokens=190)
              for i in range(len(prompts))]
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(backend, "fused_decode", None)
    copies = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused == copies  # (the fixture checks the pool is whole after the test)


def test_the_kernel_is_built_once_per_machine_and_kept(tmp_path, monkeypatch, caplog):
    if KERNEL is None:
        pytest.skip("the decode kernel does not build here")
    monkeypatch.setenv("ENCDEC_CACHE", str(tmp_path))
    caplog.set_level(logging.INFO, logger=cpu_decode.__name__)
    cpu_decode.load.cache_clear()
    try:
        assert cpu_decode.load() is not None
        built = list((tmp_path / "kernels").glob("cpu_decode-*.so"))
        assert len(built) == 1 and "built the fused CPU decode attention kernel" in caplog.text
        caplog.clear()
        cpu_decode.load.cache_clear()
        assert cpu_decode.load().path == built[0] and "built" not in caplog.text  # the kept one, not rebuilt
    finally:
        cpu_decode.load.cache_clear()


@pytest.mark.parametrize("env,reason", [({"ENCDEC_FUSED_DECODE": "0"}, "ENCDEC_FUSED_DECODE=0"),
                                        ({"CC": "/nonexistent/cc"}, "/nonexistent/cc does not run")])
def test_without_the_kernel_the_log_says_why(env, reason, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ENCDEC_CACHE", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.INFO, logger=cpu_decode.__name__)
    cpu_decode.load.cache_clear()
    try:
        assert cpu_decode.load() is None
        assert reason in caplog.text and "decode reads use head-major copies" in caplog.text
    finally:
        cpu_decode.load.cache_clear()


def test_a_compiler_error_is_reported_with_its_message(tmp_path, monkeypatch, caplog):
    if not sys.platform.startswith("linux") or not shutil.which("cc") or cpu_decode._openmp_runtime() is None:
        pytest.skip("no C compiler or OpenMP runtime")
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setenv("ENCDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "SOURCE", broken)
    cpu_decode.load.cache_clear()
    try:
        assert cpu_decode.load() is None
        assert "failed" in caplog.text and "broken.c" in caplog.text
        assert not list((tmp_path / "kernels").glob("*"))  # no half-written library left to load later
    finally:
        cpu_decode.load.cache_clear()


PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {  /* runs at dlopen, before any check */
    const char *marker = getenv("PLANTED_MARKER");
    FILE *f = marker ? fopen(marker, "w") : NULL;
    if (f) { fputs("constructor ran", f); fclose(f); }
}
int unrelated(void) { return 0; }
"""
OTHER_UID = 4242  # no account uses it


def planted_library(tmp_path):
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    library = tmp_path / "planted.so"
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    return library


@needs_kernel
@pytest.mark.parametrize("plant,reason", [
    ("in a folder of another user", f"belongs to uid {OTHER_UID}, not to this user"),
    ("in this user's folder others could write", "could be written by other users (mode 0777)"),
    ("as another user's library", f"belongs to uid {OTHER_UID}, not to this user"),
    ("as this user's library others can write", "can be written by other users (mode 0666)"),
    ("as a symlink", "Too many levels of symbolic links"),
])
def test_a_library_planted_in_the_cache_never_runs(plant, reason, tmp_path, monkeypatch, caplog):
    """A shared cache folder let another user put a library at the kernel's name (the same for every
    user): it was loaded, its constructor ran before the numeric check, and the check only warned. Now
    nothing that another user could have written is loaded: another user's folder is refused; in this
    user's folder the library is removed and the kernel built anew."""
    if "another user" in plant and os.geteuid() != 0:
        pytest.skip("needs root to give files to another uid")
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    kernels = cache / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    target = kernels / KERNEL.path.name
    planted = planted_library(tmp_path)
    if plant == "as a symlink":
        target.symlink_to(planted)
    else:
        shutil.copy(planted, target)
    if plant == "in a folder of another user":
        os.chown(kernels, OTHER_UID, OTHER_UID)
        os.chown(target, OTHER_UID, OTHER_UID)
    elif plant == "in this user's folder others could write":
        kernels.chmod(0o777)
        os.chown(target, OTHER_UID, OTHER_UID)
    elif plant == "as another user's library":
        os.chown(target, OTHER_UID, OTHER_UID)
    elif plant == "as this user's library others can write":
        target.chmod(0o666)
    monkeypatch.setenv("ENCDEC_CACHE", str(cache))
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    caplog.set_level(logging.INFO, logger=cpu_decode.__name__)
    cpu_decode.load.cache_clear()
    try:
        kernel = cpu_decode.load()
        assert not marker.exists()
        assert reason in caplog.text
        if plant == "in a folder of another user":
            assert kernel is None and "decode reads use head-major copies" in caplog.text
        else:  # this user's folder: the planted file removed, the kernel built anew and loaded
            assert kernel is not None and "built the fused CPU decode attention kernel" in caplog.text
            assert stat.S_IMODE(kernels.stat().st_mode) & 0o022 == 0 and target.stat().st_uid == os.geteuid()
    finally:
        cpu_decode.load.cache_clear()


@needs_kernel
def test_a_library_without_the_kernels_functions_falls_back_with_the_reason(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    shutil.copy(planted_library(tmp_path), cache / "kernels" / KERNEL.path.name)
    monkeypatch.setenv("ENCDEC_CACHE", str(cache))
    cpu_decode.load.cache_clear()
    try:
        assert cpu_decode.load() is None  # was an AttributeError at model load
        assert "is not this kernel" in caplog.text and "decode_scores" in caplog.text
    finally:
        cpu_decode.load.cache_clear()


def test_operands_laid_out_unlike_the_c_struct_are_refused_at_load(tmp_path, monkeypatch, caplog):
    """The kernel's operands travel as one struct, named in C and in Python alike; the library reports its
    size and offsets and a difference (here `threads` as a 32-bit int) is refused before any call."""
    if KERNEL is None:
        pytest.skip("the decode kernel does not build here")
    fields = [(name, ctypes.c_int32 if name == "threads" else kind) for name, kind in cpu_decode.DecodeArgs._fields_]
    monkeypatch.setattr(cpu_decode, "DecodeArgs", type("Shifted", (ctypes.Structure,), {"_fields_": fields}))
    monkeypatch.setenv("ENCDEC_CACHE", str(tmp_path))
    cpu_decode.load.cache_clear()
    try:
        assert cpu_decode.load() is None
        assert "its struct decode_args (22 fields, 176 bytes" in caplog.text and "is not DecodeArgs" in caplog.text
    finally:
        cpu_decode.load.cache_clear()
