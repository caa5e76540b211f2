"""The one reader of safetensors files the importer uses.

A safetensors file is an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte range) and the tensors' bytes. This reads a tensor, or
rows of its first axis (one expert's, or a shard's experts'), with plain file reads
into a fresh array. The `safetensors` package's own NumPy reader has no FP8 dtype
(FP8 checkpoints need one) and reads through a memory map whose pages stay resident;
`tests/test_hf_quantized.py` checks this reader against it on every dtype both read.
"""

import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np

# safetensors dtype names -> NumPy dtypes (E8M0 scales kept as their bytes).
_NUMPY = {
    "F8_E4M3": jnp.float8_e4m3fn,
    "F8_E8M0": np.uint8,
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": jnp.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
}


class TensorFile:
    """One safetensors file: its header, and its tensors read by rows."""

    def __init__(self, path: pathlib.Path):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.header = header
        self.start = 8 + size

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows `start:stop` of the first axis of tensor `name` (all of it by
        default; a scalar is read whole)."""
        dtype = self.dtype(name)
        if dtype not in _NUMPY:
            raise ValueError(f"{name} is stored as {dtype}, which is not read.")
        shape = self.shape(name)
        item = np.dtype(_NUMPY[dtype]).itemsize
        if not shape:
            start, stop, rows, row = 0, 1, (), item
        else:
            stop = shape[0] if stop is None else stop
            rows, row = (stop - start, *shape[1:]), math.prod(shape[1:]) * item
        out = np.empty((stop - start) * row, np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.start + self.header[name]["data_offsets"][0] + start * row)
            if f.readinto(out) != out.size:
                raise ValueError(f"{self.path} ends inside the tensor {name}.")
        return out.view(_NUMPY[dtype]).reshape(rows)


def tensor_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file holding it, from a model directory's
    `model.safetensors.index.json` or its single `model.safetensors`."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"{directory} has neither model.safetensors.index.json nor "
            "model.safetensors."
        )
    return dict.fromkeys(TensorFile(single).keys(), single)
