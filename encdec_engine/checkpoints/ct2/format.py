"""Read a CTranslate2 ``model.bin`` into named tensors.

Binary layout (little-endian; a *string* is a uint16 byte length that counts a trailing
NUL, then the UTF-8 bytes and the NUL):

- header: uint32 binary version, string spec name (e.g. ``WhisperSpec``), uint32 spec revision;
- uint32 variable count, then per variable: string name, uint8 rank, ``rank`` x uint32 shape,
  uint8 dtype id, uint32 byte count, the raw data;
- uint32 alias count, then per alias: string alias, string target variable.

Quantized exports store int8/int16 weights ``q = round(w * scale)`` next to a ``<name>_scale``
variable; :func:`dequantize` turns them back into float32.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import torch

# Type ids of model.bin, in CTranslate2's order.
_CT2_DTYPES = (torch.float32, torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16)
# Version 4 is the first to store a dtype id per variable (earlier files only store
# the item size, which cannot tell int16 from float16); 6 is the newest we know.
_SUPPORTED_BINARY_VERSIONS = range(4, 7)


def _read_string(f: BinaryIO) -> str:
    # uint16 length that counts the trailing NUL, then the UTF-8 bytes and the NUL.
    (length,) = struct.unpack("<H", f.read(2))
    return f.read(length)[:-1].decode("utf-8")


def read_ct2_header(f: BinaryIO) -> tuple[int, str]:
    (version,) = struct.unpack("<I", f.read(4))
    if version not in _SUPPORTED_BINARY_VERSIONS:
        raise ValueError(f"unsupported CTranslate2 binary version {version}")
    spec = _read_string(f)
    f.read(4)  # spec revision: unused; the mapped names are checked against HF's model instead
    return version, spec


def read_ct2_variables(model_bin: str | Path) -> tuple[str, dict[str, torch.Tensor]]:
    """Read every variable of a CTranslate2 ``model.bin``; aliases map to the same tensor.

    Returns the model spec name (e.g. ``"WhisperSpec"``) and ``{name: tensor}``.
    """
    variables: dict[str, torch.Tensor] = {}
    with open(model_bin, "rb") as f:
        _, spec = read_ct2_header(f)
        (count,) = struct.unpack("<I", f.read(4))
        for _ in range(count):
            name = _read_string(f)
            (rank,) = struct.unpack("<B", f.read(1))
            shape = struct.unpack(f"<{rank}I", f.read(4 * rank))
            dtype_id, num_bytes = struct.unpack("<BI", f.read(5))
            data = bytearray(f.read(num_bytes))
            if len(data) != num_bytes:
                raise ValueError(f"{model_bin} is truncated inside variable {name!r}")
            if dtype_id >= len(_CT2_DTYPES):
                raise ValueError(f"{model_bin}: unknown dtype id {dtype_id} for {name!r}")
            tensor = torch.frombuffer(data, dtype=_CT2_DTYPES[dtype_id]) if data else torch.empty(0)
            variables[name] = tensor.reshape(shape)
        (num_aliases,) = struct.unpack("<I", f.read(4))
        for _ in range(num_aliases):
            alias, target = _read_string(f), _read_string(f)
            variables[alias] = variables[target]
            # Like CT2's loader: an aliased quantized weight shares its scale too.
            if target + "_scale" in variables:
                variables[alias + "_scale"] = variables[target + "_scale"]
    return spec, variables


def dequantize(variables: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Turn int8/int16 weights of quantized exports back into float32 using their ``*_scale``."""
    done: dict[int, torch.Tensor] = {}  # keyed by id() so aliases stay one shared tensor
    out: dict[str, torch.Tensor] = {}
    for name, value in variables.items():
        scale = variables.get(name + "_scale")
        if scale is not None and not value.is_floating_point():
            if id(value) not in done:
                # CT2 stores q = round(w * scale): one scale per output row, or one per tensor.
                scale = scale.float().reshape(-1, *[1] * (value.dim() - 1)) if scale.dim() else scale.float()
                done[id(value)] = value.float() / scale
            value = done[id(value)]
        out[name] = value
    return out
