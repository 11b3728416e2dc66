"""Convert a CTranslate2 Whisper model folder into a Hugging Face Whisper checkpoint.

CTranslate2 (faster-whisper) folders hold ``model.bin``, ``config.json``,
``tokenizer.json`` and ``vocabulary.txt`` (or ``vocabulary.json``). The importer
writes a folder that ``WhisperForConditionalGeneration``, ``WhisperTokenizer``,
``WhisperFeatureExtractor`` and ``WhisperProcessor`` load with ``from_pretrained``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from encdec_engine.checkpoints.ct2.bundled import bundled_fingerprint, bundled_model_dir, verify_bundled
from encdec_engine.checkpoints.ct2.format import dequantize, read_ct2_header, read_ct2_variables
from encdec_engine.cache import IMPORT_MARKER, cache_root
from encdec_engine.files import fsync_file, fsync_folder

_GELU = 3  # ctranslate2.specs.common_spec.Activation.GELU
IMPORTER_VERSION = 1  # bump when the written checkpoint changes, to refresh caches
_SMALL_FILE = 1 << 20  # bytes up to which a file's content, not its modification time, keys an import
MODEL_NAME = "whisper-tiny.en"


def _scalar(variables: dict[str, torch.Tensor], name: str, default: int) -> int:
    value = variables.get(name)
    return default if value is None else int(value.item())


def _check_whisper_layout(v: dict[str, torch.Tensor]) -> None:
    # The HF model hard-codes these choices; refuse files that made different ones.
    expected = {"decoder/pre_norm": 1, "decoder/activation": _GELU, "decoder/alibi": 0}
    for name, want in expected.items():
        if name in v and _scalar(v, name, want) != want:
            raise ValueError(f"unsupported Whisper variant: {name} = {_scalar(v, name, want)}")
    if "decoder/scale_embeddings" in v and float(v["decoder/scale_embeddings"].item()) not in (0.0, 1.0):
        raise ValueError("unsupported Whisper variant: scaled decoder embeddings")


def _hf_state_dict(v: dict[str, torch.Tensor], d_model: int) -> dict[str, torch.Tensor]:
    """Rename CT2 variables to ``WhisperForConditionalGeneration`` parameter names."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        used.add(name)
        return v[name]

    def linear(src: str, dst: str) -> None:
        out[f"{dst}.weight"] = get(f"{src}/weight")
        if f"{src}/bias" in v:
            out[f"{dst}.bias"] = get(f"{src}/bias")

    def layer_norm(src: str, dst: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = get(f"{src}/gamma"), get(f"{src}/beta")

    def split(src: str, dsts: list[str]) -> None:
        # Fused projections are stacked along the output dimension: [len(dsts) * d_model, d_model].
        for dst, weight in zip(dsts, get(f"{src}/weight").split(d_model), strict=True):
            out[f"{dst}.weight"] = weight
        for dst, bias in zip(dsts, get(f"{src}/bias").split(d_model), strict=True):
            # HF's k_proj has no bias. Dropping it is exact even if CT2 stored a non-zero
            # one: it adds the same q.b_k to every key's logit, which softmax cancels.
            if not dst.endswith("k_proj"):
                out[f"{dst}.bias"] = bias

    def fold_query_scale(src: str, dst: str, num_heads: int) -> None:
        # CT2 may replace the usual 1/sqrt(head_dim) by an explicit queries_scale; HF always
        # applies 1/sqrt(head_dim), so fold the ratio into the query projection.
        if f"{src}/queries_scale" in v:
            factor = float(get(f"{src}/queries_scale").item()) * (d_model // num_heads) ** 0.5
            for suffix in (".weight", ".bias"):
                out[f"{dst}.q_proj{suffix}"] = out[f"{dst}.q_proj{suffix}"].float() * factor

    for side in ("encoder", "decoder"):
        num_heads = _scalar(v, f"{side}/num_heads", 0)
        hf = f"model.{side}"
        out[f"{hf}.embed_positions.weight"] = get(f"{side}/position_encodings/encodings")
        layer_norm(f"{side}/layer_norm", f"{hf}.layer_norm")
        for i in range(_count_layers(v, side)):
            src, dst = f"{side}/layer_{i}", f"{hf}.layers.{i}"
            # Self-attention: linear_0 = fused q/k/v, linear_1 = output projection.
            split(f"{src}/self_attention/linear_0", [f"{dst}.self_attn.{p}_proj" for p in "qkv"])
            linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
            layer_norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
            fold_query_scale(f"{src}/self_attention", f"{dst}.self_attn", num_heads)
            if side == "decoder":
                # Cross-attention: linear_0 = q, linear_1 = fused k/v, linear_2 = output.
                linear(f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
                split(f"{src}/attention/linear_1", [f"{dst}.encoder_attn.{p}_proj" for p in "kv"])
                linear(f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
                layer_norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
                fold_query_scale(f"{src}/attention", f"{dst}.encoder_attn", num_heads)
            linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
            linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
            layer_norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
    for conv in ("conv1", "conv2"):
        linear(f"encoder/{conv}", f"model.encoder.{conv}")
    embeddings, projection = get("decoder/embeddings/weight"), get("decoder/projection/weight")
    out["model.decoder.embed_tokens.weight"] = embeddings
    if projection is not embeddings:  # CT2 stores a tied projection as an alias
        out["proj_out.weight"] = projection
    # A CT2 tensor without an HF counterpart would be silently lost: refuse instead.
    left = [n for n, t in v.items() if t.dim() and n not in used and not n.endswith("_scale")]
    if left:
        raise ValueError(f"CT2 variables with no HF Whisper counterpart: {left[:5]}")
    return out


def _count_layers(v: dict[str, torch.Tensor], side: str) -> int:
    pattern = re.compile(rf"{side}/layer_(\d+)/")
    return 1 + max(int(m.group(1)) for name in v if (m := pattern.match(name)))


def _read_vocabulary(src: Path) -> list[str]:
    if (src / "vocabulary.json").is_file():
        return json.loads((src / "vocabulary.json").read_text(encoding="utf-8"))
    lines = (src / "vocabulary.txt").read_text(encoding="utf-8").split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def _generation_fields(ct2_config: dict, vocab: list[str], ids: dict[str, int]) -> dict:
    """Fields of HF's Whisper ``generation_config.json`` derivable from the CT2 folder."""
    sot, eot = ids["<|startoftranscript|>"], ids["<|endoftext|>"]
    fields = {
        "decoder_start_token_id": sot,
        "bos_token_id": sot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "max_length": 448,
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "prev_sot_token_id": ids["<|startofprev|>"],
        "max_initial_timestamp_index": 50,  # 1 s, as in OpenAI's decoding options
        "return_timestamps": False,
        "suppress_tokens": list(ct2_config.get("suppress_ids", [])),
        "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin", [])),
        "alignment_heads": [list(pair) for pair in ct2_config.get("alignment_heads", [])],
        # HF's own rule: English-only checkpoints have 51864 tokens, multilingual ones more.
        "is_multilingual": len(vocab) >= 51865,
    }
    if fields["is_multilingual"]:
        # Language tokens sit between <|startoftranscript|> and <|translate|>. lang_to_id must
        # stay absent on English-only models, otherwise HF runs language detection.
        fields["lang_to_id"] = {vocab[i]: i for i in range(sot + 1, ids["<|translate|>"])}
        fields["task_to_id"] = {t: ids[f"<|{t}|>"] for t in ("transcribe", "translate")}
        # Without this HF would prompt [sot, lang, notimestamps] with no task token.
        fields["forced_decoder_ids"] = [[1, None], [2, ids["<|transcribe|>"]]]
    return fields


def _write_tokenizer_and_features(src: Path, dst: Path, vocab: list[str], n_mels: int) -> None:
    from tokenizers import AddedToken
    from transformers import WhisperFeatureExtractor, WhisperTokenizer

    spec = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    specials = [t["content"] for t in spec.get("added_tokens", []) if t.get("special")]
    tokenizer = WhisperTokenizer(
        tokenizer_file=str(src / "tokenizer.json"),
        additional_special_tokens=specials,
        model_max_length=1024,
        pad_token="<|endoftext|>",
    )
    # CT2 exports keep timestamp tokens (<|0.00|>...) only in the vocabulary; HF checkpoints
    # carry them as non-special added tokens so decode(..., decode_with_timestamps=True) works.
    extra = [AddedToken(t, special=False, normalized=False) for t in vocab[len(tokenizer) :]]
    tokenizer.add_tokens(extra)
    tokenizer.save_pretrained(dst)
    # Saved on its own: a v5 WhisperProcessor folds it into processor_config.json instead.
    WhisperFeatureExtractor(feature_size=n_mels).save_pretrained(dst)


def import_ct2_whisper(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert the CTranslate2 Whisper folder ``src`` into a Hugging Face checkpoint in ``dst``.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (weights cast to
    ``dtype``; quantized exports are dequantized first), the tokenizer files and
    ``preprocessor_config.json``. Raises ``FileNotFoundError`` for missing inputs and
    ``ValueError`` for a file that is not a supported CTranslate2 Whisper model.
    """
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    src, dst = Path(src), Path(dst)
    for name in ("model.bin", "config.json", "tokenizer.json"):
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src / name} not found: not a CTranslate2 Whisper folder")
    spec, variables = read_ct2_variables(src / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{src / 'model.bin'} holds a {spec!r} model, not a WhisperSpec")
    v = dequantize(variables)
    _check_whisper_layout(v)
    vocab = _read_vocabulary(src)
    ids = {token: i for i, token in enumerate(vocab)}
    ct2_config = json.loads((src / "config.json").read_text(encoding="utf-8"))

    embeddings = v["decoder/embeddings/weight"]  # [vocab_size, d_model]
    conv1 = v["encoder/conv1/weight"]  # [d_model, n_mels, 3]
    d_model, n_mels = conv1.shape[0], conv1.shape[1]
    if embeddings.shape[0] != len(vocab):
        raise ValueError(f"vocabulary has {len(vocab)} tokens but the embeddings {embeddings.shape[0]}")
    state = _hf_state_dict(v, d_model)
    generation = _generation_fields(ct2_config, vocab, ids)
    token_ids = {k: generation[k] for k in ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id")}
    config = WhisperConfig(
        vocab_size=len(vocab),
        num_mel_bins=n_mels,
        d_model=d_model,
        encoder_layers=_count_layers(v, "encoder"),
        decoder_layers=_count_layers(v, "decoder"),
        encoder_attention_heads=_scalar(v, "encoder/num_heads", 0),
        decoder_attention_heads=_scalar(v, "decoder/num_heads", 0),
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
        tie_word_embeddings="proj_out.weight" not in state,
        architectures=["WhisperForConditionalGeneration"],
        dtype=dtype,
        **token_ids,
    )
    # Check names and shapes against a weightless model so a wrong mapping fails here, not at load.
    with torch.device("meta"):
        expected = WhisperForConditionalGeneration(config).state_dict()
    if config.tie_word_embeddings:
        expected.pop("proj_out.weight")
    if set(expected) != set(state):
        raise ValueError(f"weight mapping mismatch: {sorted(set(expected) ^ set(state))[:8]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{name}: CT2 shape {tuple(tensor.shape)} != HF {tuple(expected[name].shape)}")

    dst.mkdir(parents=True, exist_ok=True)
    # copy=True: split() returns views, and safetensors refuses tensors sharing storage.
    tensors = {k: t.to(dtype=dtype, copy=True).contiguous() for k, t in state.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(dst)
    GenerationConfig(**generation).save_pretrained(dst)
    _write_tokenizer_and_features(src, dst, vocab, n_mels)
    return dst


def is_ct2_model_dir(path: str | Path) -> bool:
    """True when ``path`` is a folder with a readable CTranslate2 ``model.bin`` and ``config.json``."""
    path = Path(path)
    if not (path / "model.bin").is_file() or not (path / "config.json").is_file():
        return False
    try:
        with open(path / "model.bin", "rb") as f:
            read_ct2_header(f)
    except (ValueError, struct.error, UnicodeDecodeError):
        return False
    return True


def _fingerprint(src: Path) -> dict:
    """What the import of the folder `src` depends on: the importer, and the folder's content (each file's
    name and size, the small files' bytes, the large ones' modification times: hashing a GB of weights at
    every start would cost a second)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith(".")):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0".encode())
        digest.update(path.read_bytes() if stat.st_size <= _SMALL_FILE else str(stat.st_mtime_ns).encode())
    return {"importer": IMPORTER_VERSION, "content": digest.hexdigest()}


def _is_complete(path: Path, fingerprint: dict) -> bool:
    try:
        return json.loads((path / IMPORT_MARKER).read_text()) == fingerprint
    except (OSError, ValueError):
        return False


def _refuse_others_import(dst: Path) -> None:
    """An outdated import in `dst` is replaced only by its owner: in a shared cache another user's folder
    can be neither deleted nor, in a sticky folder (mode 1777), renamed by this one."""
    owner, me = dst.stat().st_uid, os.geteuid()
    if owner != me and me != 0:
        raise PermissionError(f"{dst} holds an import made by uid {owner} that this user cannot read or that is "
                              f"out of date (another release or importer); it is only read here, never replaced: ask "
                              f"its owner to import it again, or use a cache of your own (ENCDEC_CACHE, --model-dir)")


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _import_once(src: Path, dst: Path, fingerprint: dict, verify: Callable[[Path], None] | None = None) -> Path:
    """`dst`, holding the import of `src` unless it holds it already (same fingerprint). `verify(src)` runs
    before anything reads `src` as weights. Written to a temporary sibling folder, synced, marked
    complete, then renamed into place: a crash or a power loss never leaves a usable half import, and
    processes importing at once all end with one whole folder. Folders and files get the umask's modes,
    so that a cache one user fills can be read by others."""
    if _is_complete(dst, fingerprint):
        return dst
    if dst.exists():
        _refuse_others_import(dst)
    if verify is not None:
        verify(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    stale = dst.parent / f"{tmp.name}.stale"
    try:
        import_ct2_whisper(src, tmp)
        (tmp / IMPORT_MARKER).write_text(json.dumps(fingerprint))
        umask = _umask()  # mkdtemp's 0700 and safetensors' 0600 would hide the import from a cache's other users
        tmp.chmod(0o777 & ~umask)
        for path in tmp.iterdir():
            path.chmod(0o666 & ~umask)
            fsync_file(path)
        fsync_folder(tmp)
        if dst.exists():  # an outdated or incomplete import: move it aside first
            dst.rename(stale)
        try:
            tmp.rename(dst)
        except OSError:
            # Another process published its import between our checks; use that one.
            if not _is_complete(dst, fingerprint):
                raise
        fsync_folder(dst.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
    return dst


def default_model_path(root: str | Path | None = None) -> Path:
    """Path of the HF checkpoint of the bundled tiny.en model (checkpoints/ct2/bundled.py), importing it on
    first use.

    The cache root is ``root`` if given, else ``$ENCDEC_CACHE`` (default ``~/.cache/encdec-engine``);
    the model lives in its ``whisper-tiny.en`` folder, imported again when the importer or the pinned
    release changes. The package's files are checked against their recorded sha256 before the import.
    """
    fingerprint = {"importer": IMPORTER_VERSION, "content": bundled_fingerprint()}
    return _import_once(bundled_model_dir(), cache_root(root) / MODEL_NAME, fingerprint, verify_bundled)


def cached_import(src: str | Path, root: str | Path | None = None) -> Path:
    """The HF checkpoint of the CTranslate2 (faster-whisper) folder `src`, imported once into the engine's
    cache (``<root>/ct2/<folder name>-<content key>``) and again only when the folder's content changes.
    Nothing is ever written into `src`: it may be read-only, or read by other processes meanwhile."""
    src = Path(src).expanduser().resolve()
    fingerprint = _fingerprint(src)
    return _import_once(src, cache_root(root) / "ct2" / f"{src.name}-{fingerprint['content'][:16]}", fingerprint)
