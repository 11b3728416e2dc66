"""Reading Hugging Face checkpoints (safetensors or .bin) into our modules.

Tied weights follow transformers 5's `from_pretrained` (`PreTrainedModel.tie_weights`), not the config
alone: a model states its tied pairs (none unless `tie_word_embeddings`), and a pair whose two tensors
the checkpoint holds with different values stays untied, as HF leaves it (with a warning), so a
checkpoint HF serves is served here with the same weights rather than refused.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from encdec_engine.checkpoints.json_files import read_json

logger = logging.getLogger(__name__)


def weight_files(folder: str | Path) -> list[Path]:
    """The checkpoint's weight files: safetensors when there are any, else PyTorch `.bin`; one file,
    or the shards an index (`model.safetensors.index.json`, `pytorch_model.bin.index.json`) names."""
    folder = Path(folder)
    files = _weight_files(folder, "model.safetensors", ".safetensors") or _weight_files(folder, "pytorch_model.bin",
                                                                                        ".bin")
    if not files:
        raise FileNotFoundError(f"{folder}: no weights (model.safetensors, pytorch_model.bin, or shards with "
                                "their .index.json)")
    return files


def iter_checkpoint(folder: str | Path, files: list[Path] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every weight of a checkpoint folder (or of its `files`), in the file's dtype."""
    for file in files or weight_files(folder):
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            yield from torch.load(file, map_location="cpu", weights_only=True).items()


def _weight_files(folder: Path, single: str, suffix: str) -> list[Path]:
    if (folder / single).is_file():
        return [folder / single]
    index = folder / f"{single}.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map (tensor name -> shard file)")
        shards = [folder / s for s in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ValueError(f"{index}: weight_map names shard files that are not there: {', '.join(missing)}")
        return shards
    return sorted(p for p in folder.glob(f"*{suffix}") if p.is_file())


# HF attention projections and the fused weights we keep instead: name part -> (fused part, shard, shards)
_FUSED = {
    "self_attn.q_proj.": ("self_attn.qkv_proj.", 0, 3),
    "self_attn.k_proj.": ("self_attn.qkv_proj.", 1, 3),
    "self_attn.v_proj.": ("self_attn.qkv_proj.", 2, 3),
    "encoder_attn.k_proj.": ("encoder_attn.kv_proj.", 0, 2),
    "encoder_attn.v_proj.": ("encoder_attn.kv_proj.", 1, 2),
}


# An encoder/decoder checkpoint's token embeddings and output head, as HF names them (after "model."): the
# tensors the BART family and T5 hold aside (`WeightLoader.hold`) until their ties are known.
SHARED, ENCODER_EMBEDDING, DECODER_EMBEDDING, LM_HEAD = ("shared.weight", "encoder.embed_tokens.weight",
                                                          "decoder.embed_tokens.weight", "lm_head.weight")


def resolve_ties(ties: Sequence[tuple[str, str]], held: dict[str, torch.Tensor],
                 usually_apart: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """The tensor each name of `held` (checkpoint tensors) or of `ties` ends up with, tied names sharing
    one tensor object, as transformers 5's `tie_weights(missing_keys=...)` decides at `from_pretrained`.

    `ties` are the model's (target, source) pairs in HF's order. Per pair: both in the checkpoint and
    equal, tied; both there and different, untied (HF warns); only one there, the other takes it (HF
    swaps source and target); neither, a later pair's target of the same source gives it, else the
    name stays missing (HF would leave it random; the loader refuses it). Targets `usually_apart` are
    untied without a warning (T5's head: transformers 5 ties it on every T5 config, v1.1's included)."""
    values = dict(held)
    for i, (target, source) in enumerate(ties):
        if target in values and source in values:
            if values[target] is values[source]:
                continue
            if not _equal(values[target], values[source]):
                log = logger.debug if target in usually_apart else logger.warning
                log("config.json ties %s to %s (tie_word_embeddings), but the checkpoint holds them apart, "
                    "with different values: loaded untied, as transformers does", target, source)
                continue
        elif target in values:
            target, source = source, target
        elif source not in values:
            source = next((t for t, s in ties[i + 1 :] if s == source and t in values), None)
            if source is None:
                continue
        values[target] = values[source]
    return values


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """HF compares the two parameters once loaded, in the model's dtype: files of two dtypes, in the wider."""
    if a.dtype != b.dtype:
        dtype = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(dtype), b.to(dtype)
    return a.shape == b.shape and torch.equal(a, b)


def tied(values: dict[str, torch.Tensor], name: str, other: str) -> bool:
    """Whether `resolve_ties` gave `name` and `other` one tensor: one module serves both."""
    return values.get(name) is not None and values.get(name) is values.get(other)


class WeightLoader:
    """Copies checkpoint tensors into a module's parameters and buffers, strictly.

    Every parameter must be loaded (bar `optional` ones) and every checkpoint
    tensor must land somewhere, so a wrong mapping fails loudly instead of
    leaving random weights behind. Token embeddings and output heads may be
    `hold`-en aside until every tensor is read: the model then learns which of
    them are tied (`resolve_ties`), shares or separates its modules to match,
    and loads them (`load_held`).
    """

    def __init__(self, module: nn.Module) -> None:
        self.targets = dict(module.named_parameters()) | dict(module.named_buffers())
        self.loaded: set[str] = set()
        self.shards: dict[str, set[int]] = {}
        self.unexpected: list[str] = []
        self.ignored: set[str] = set()
        self.holding: set[str] = set()
        self.held: dict[str, torch.Tensor] = {}

    def ignore(self, name: str) -> None:
        """Checkpoint tensor `name` is known and deliberately unused."""
        self.ignored.add(name)

    def hold(self, *names: str) -> None:
        """Keep checkpoint tensors `names` aside (in `held`) instead of loading them as they come."""
        self.holding.update(names)

    def load_held(self, module: nn.Module, values: dict[str, torch.Tensor]) -> None:
        """Load `resolve_ties`' tensors into `module` as now built: a module that serves two names (tied) is
        a target under both and gets the same tensor twice; a name with no module of its own (a head that
        is the embedding) is served by the one of the name it is tied to."""
        self.targets = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers())
        for name, tensor in values.items():
            if name not in self.targets and name not in self.ignored and any(
                    tensor is values[other] for other in values if other in self.targets):
                continue
            self._copy(name, tensor)

    def _target(self, name: str, shape: torch.Size) -> torch.Tensor | None:
        if name in self.ignored:
            return None
        target = self.targets.get(name)
        if target is None:
            self.unexpected.append(name)
        return target

    def load(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.holding:
            self.held[name] = tensor
            return
        self._copy(name, tensor)

    def _copy(self, name: str, tensor: torch.Tensor) -> None:
        target = self._target(name, tensor.shape)
        if target is None:
            return
        if target.shape != tensor.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        self.loaded.add(name)

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int, num_shards: int) -> None:
        """Load one of `num_shards` equal row blocks of a fused weight (e.g. q of qkv)."""
        target = self._target(name, tensor.shape)
        if target is None:
            return
        rows = target.shape[0] // num_shards
        if tensor.shape != (rows, *target.shape[1:]):
            raise ValueError(f"weight {name} shard {shard}: shape {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
        with torch.no_grad():
            target[shard * rows : (shard + 1) * rows].copy_(tensor)
        done = self.shards.setdefault(name, set())
        done.add(shard)
        if len(done) == num_shards:
            self.loaded.add(name)

    def load_attention(self, name: str, tensor: torch.Tensor) -> None:
        """Load one tensor, routing HF's separate q/k/v projections into our fused ones."""
        for part, (fused, shard, shards) in _FUSED.items():
            if part in name:
                self.load_shard(name.replace(part, fused), tensor, shard, shards)
                return
        self.load(name, tensor)

    def zero_missing_bias_shards(self) -> None:
        """HF's k projections have no bias: their share of a fused bias is zero."""
        for name, target in self.targets.items():
            if not name.endswith("_proj.bias") or name in self.loaded or name not in self.shards:
                continue
            shards = 3 if "qkv_proj" in name else 2
            rows = target.shape[0] // shards
            with torch.no_grad():
                for shard in set(range(shards)) - self.shards[name]:
                    target[shard * rows : (shard + 1) * rows].zero_()
            self.loaded.add(name)

    def finish(self, optional: set[str] = frozenset()) -> None:
        missing = sorted(set(self.targets) - self.loaded - set(optional))
        problems = []
        if missing:
            problems.append(f"missing weights: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        if self.unexpected:
            problems.append(f"unexpected weights: {', '.join(self.unexpected[:10])}")
        if problems:
            raise ValueError("checkpoint does not match the model: " + "; ".join(problems))
