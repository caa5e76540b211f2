"""Quantized Hugging Face checkpoints: the `quantization_config` of a model's config,
and its quantized tensors, read from the safetensors files and dequantized one expert
at a time (`moe_eqx._quant` holds the formats' rules)."""

import dataclasses
import math
import pathlib
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .._quant import (
    FP8_BLOCK,
    MXFP4_BLOCK,
    QuantizedArray,
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    e8m0_to_float32,
)
from .safetensors_file import TensorFile

_METHODS = "fp8 (FP8 E4M3 with block scales), mxfp4"
_FP8_SCALE = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`
_MXFP4_PARTS = ("_blocks", "_scales")  # `x` -> `x_blocks`, `x_scales`


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's quantized format: `method` is `"fp8"` (with `block`, the
    `weight_block_size`) or `"mxfp4"`."""

    method: str
    block: tuple[int, int] | None = None


def quant_format(hf: Mapping) -> QuantFormat | None:
    """The format a config's `quantization_config` declares (`None` without one).
    Anything this library does not dequantize exactly is a `ValueError` naming the
    key and value."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"`quantization_config` must be a mapping, got {q!r}.")
    method = q.get("quant_method")
    if method == "mxfp4":
        return QuantFormat("mxfp4")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported "
            f"(supported: {_METHODS})."
        )
    allowed = {
        "fmt": ("e4m3", "float8_e4m3fn"),
        "activation_scheme": ("dynamic",),
        "scale_fmt": ("float", "ue8m0"),  # the stored scales' dtype decides
        "expert_dtype": ("fp8",),
    }
    for key, values in allowed.items():
        if key in q and q[key] not in values:
            raise ValueError(
                f"quantization_config.{key}={q[key]!r} is not supported for "
                f"quant_method='fp8' (supported: {', '.join(map(repr, values))})."
            )
    block = q.get("weight_block_size", (128, 128))  # transformers' default
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(
            f"quantization_config.weight_block_size={block!r}: expected two positive "
            "integers (per-block scales; per-tensor scales are not supported)."
        )
    return QuantFormat("fp8", (block[0], block[1]))


_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def checkpoint_dtype(hf: Mapping):
    """The dtype a config names (`dtype`, or `torch_dtype` as older configs call it),
    which a quantized checkpoint is dequantized to by default."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), Mapping) else {}
    for source in (hf, text):
        name = source.get("dtype") or source.get("torch_dtype")
        if name is not None:
            name = str(name).removeprefix("torch.")
            if name not in _DTYPES:
                raise ValueError(
                    f"the config's dtype {name!r} is not one a quantized checkpoint is "
                    f"dequantized to ({', '.join(_DTYPES)}): pass `dtype=`."
                )
            return _DTYPES[name]
    raise ValueError(
        "a quantized checkpoint whose config names no `torch_dtype` (or `dtype`): "
        "pass `dtype=`."
    )


class Stored:
    """A quantized tensor of a checkpoint, standing for the floats it holds: `shape`
    and `dtype` are the dequantized tensor's. Nothing is read until it is converted
    to an array (`np.asarray`); `rows(a, b)` stands for rows `a:b` of its first axis
    (experts), read alone."""

    def __init__(self, shape, dtype, read: Callable[[int, int], np.ndarray], start=0):
        self.shape, self.dtype, self._read, self._start = shape, dtype, read, start

    def rows(self, start: int, stop: int) -> "Stored":
        shape = (stop - start, *self.shape[1:])
        return Stored(shape, self.dtype, self._read, self._start + start)

    def __array__(self, dtype=None, copy=None):
        out = self._read(self._start, self._start + self.shape[0])
        return out if dtype is None else out.astype(dtype)


def quantized_tensors(
    quant: QuantFormat,
    names: Mapping[str, str],
    files: Mapping[str, pathlib.Path],
    dtype,
    opened: dict[pathlib.Path, TensorFile],
) -> tuple[dict[str, str], dict[str, Stored]]:
    """One layer's quantized tensors, each as the dequantized tensor it stands for.

    **Arguments:**

    - `quant`: the checkpoint's format.
    - `names`: the layer's tensors, file name -> the name the importer reads it as.
    - `files`: tensor name -> the safetensors file holding it.
    - `dtype`: the dequantized dtype.
    - `opened`: the files whose headers are already read (updated).

    **Returns:**

    `(names, stored)`: `names` with each quantized group (an FP8 `weight` and its
    `weight_scale_inv`; MXFP4's `x_blocks` and `x_scales`) replaced by the tensor it
    stands for (`weight`; `x`), and those tensors by name. A missing scale tensor,
    or a tensor of an unexpected dtype or shape, is a `ValueError` naming it.
    """

    def file(name):
        path = files[name]
        if path not in opened:
            opened[path] = TensorFile(path)
        return opened[path]

    group = _fp8_group if quant.method == "fp8" else _mxfp4_group
    names = dict(names)
    stored = {}
    for name in sorted(names):
        found = name in names and group(quant, name, names, file, dtype)
        if not found:
            continue
        parts, tensor, value = found
        # The importer's name for it: its first part's, less the same suffix.
        as_name = names[parts[0]]
        as_name = as_name[: len(as_name) - (len(parts[0]) - len(tensor))]
        for part in parts:
            del names[part]
        names[tensor] = as_name
        stored[tensor] = value
    for name in names:
        if name not in stored and file(name).dtype(name).startswith(("F8", "F4")):
            raise ValueError(
                f"{name} is stored as {file(name).dtype(name)} without a scale "
                f"tensor (expected {name}{_FP8_SCALE} for quant_method='fp8')."
            )
    return names, stored


def _fp8_group(quant, name, names, file, dtype):
    """`(parts, weight name, Stored)` when `name` is an FP8 block-scale tensor."""
    if not name.endswith(_FP8_SCALE):
        return None
    weight = name[: -len(_FP8_SCALE)]
    if weight not in names:
        raise ValueError(f"{name} scales a tensor {weight} the checkpoint lacks.")
    w_file, s_file = file(weight), file(name)
    shape = w_file.shape(weight)
    if w_file.dtype(weight) != "F8_E4M3" or len(shape) != 2:
        raise ValueError(
            f"{weight} is {w_file.dtype(weight)} {list(shape)}: an FP8 block-scaled "
            "weight is read as F8_E4M3 with two axes (one expert's `[out, in]`)."
        )
    if s_file.dtype(name) not in ("F32", "BF16", "F8_E8M0", "U8"):
        raise ValueError(f"{name} is {s_file.dtype(name)}: expected F32 or E8M0.")
    grid = tuple(-(-n // b) for n, b in zip(shape, quant.block, strict=True))
    if s_file.shape(name) != grid:
        raise ValueError(
            f"{name} has shape {list(s_file.shape(name))}, expected {list(grid)} "
            f"(the blocks of {quant.block[0]} x {quant.block[1]} of {weight} "
            f"{list(shape)})."
        )

    def read(start, stop):
        if (start, stop) != (0, shape[0]):  # block rows are not expert rows
            raise ValueError(f"{weight} is read whole, not by rows.")
        w, s = w_file.read(weight), s_file.read(name)
        return dequantize_fp8_blocks(w, s, quant.block, dtype)

    return (weight, name), weight, Stored(shape, dtype, read)


def _mxfp4_group(quant, name, names, file, dtype):
    """`(parts, tensor name, Stored)` when `name` is an MXFP4 `x_blocks`/`x_scales`
    tensor: `x` is `[E, in, out]`, as transformers' dequantization lays it out."""
    if not name.endswith(_MXFP4_PARTS):
        return None
    base = name[: -len("_blocks")]  # both suffixes are as long
    blocks, scales = (base + suffix for suffix in _MXFP4_PARTS)
    for part in (blocks, scales):
        if part not in names:
            raise ValueError(f"{part} is missing beside {name} (MXFP4).")
    if name != blocks:
        return None  # the group is found by its blocks
    b_file, s_file = file(blocks), file(scales)
    b_shape, s_shape = b_file.shape(blocks), s_file.shape(scales)
    if (
        b_file.dtype(blocks) != "U8"
        or s_file.dtype(scales) != "U8"
        or len(b_shape) != 4
        or b_shape[-1] != MXFP4_BLOCK // 2
        or s_shape != b_shape[:-1]
    ):
        raise ValueError(
            f"{blocks} ({b_file.dtype(blocks)} {list(b_shape)}) and {scales} "
            f"({s_file.dtype(scales)} {list(s_shape)}): expected U8 "
            f"[experts, out, groups, {MXFP4_BLOCK // 2}] and U8 [experts, out, groups]."
        )
    e, out, groups, _ = b_shape

    def read(start, stop):
        b = b_file.read(blocks, start, stop)
        s = s_file.read(scales, start, stop)
        return np.swapaxes(dequantize_mxfp4(b, s, dtype), 1, 2)

    return (blocks, scales), base, Stored((e, groups * MXFP4_BLOCK, out), dtype, read)


def _float32_scales(s: np.ndarray) -> np.ndarray:
    """Stored block scales (float32, bfloat16 or E8M0 bytes) as float32, exactly."""
    if s.dtype == np.uint8:
        return e8m0_to_float32(s)
    return s.astype(np.float32)


def stored_experts(
    quant: QuantFormat,
    prefix: str,
    files: Mapping[str, pathlib.Path],
    num_experts: int,
    dtype,
    expert_names,
    experts: tuple[int, int] | None = None,
    device=None,
) -> tuple[QuantizedArray, QuantizedArray]:
    """A layer's routed experts as the checkpoint stores them, in the layer's layout:
    their bytes and scales only, never a float copy.

    **Arguments:**

    - `quant`: the checkpoint's format.
    - `prefix`: the MoE block's tensor prefix.
    - `files`: tensor name -> the safetensors file holding it.
    - `num_experts`: `E`.
    - `dtype`: the dtype the weights dequantize to.
    - `expert_names`: the per-expert `(gate, up, down)` names to look for (FP8).
    - `experts`: `(start, stop)`: only those experts, read alone (MXFP4: those rows
        of the fused tensors); `None`: all `E`.
    - `device`: where the arrays go (default: JAX's default device).

    **Returns:**

    `(w_gate_up, w_down)`, [`moe_eqx.QuantizedArray`][]s `[E, d_model, 2 d_ff]` and
    `[E, d_ff, d_model]` (`stop - start` experts with `experts`). A layout other
    than per-expert FP8 weights (DeepSeek-V3) or GPT-OSS's fused MXFP4 tensors, or
    FP8 blocks other than 128 x 128, is a `ValueError`.
    """
    opened: dict[pathlib.Path, TensorFile] = {}
    start, stop = (0, num_experts) if experts is None else experts

    def read(name, rows=None):
        if name not in files:
            raise ValueError(f"{name} is missing (`keep_quantized=True`).")
        path = files[name]
        if path not in opened:
            opened[path] = TensorFile(path)
        return opened[path].read(name, *(rows or ()))

    n = stop - start

    def put(out):
        # An aligned host buffer is aliased by the CPU runtime (another device
        # gets one copy).
        return jax.device_put(out, device, may_alias=True)

    def stacked(pieces):
        """The block's experts, `pieces(i)` each, written one at a time into one
        host buffer: the import holds the result and one expert's tensors."""
        out = None
        for j, i in enumerate(range(start, stop)):
            piece = pieces(i)
            if out is None:
                out = aligned_empty((n, *piece.shape), piece.dtype)
            out[j] = piece
        return put(out)

    if quant.method == "mxfp4":
        base = prefix + "experts."

        def fused(proj, part):
            name = f"{base}{proj}_{part}"

            def piece(i):
                t = read(name, (i, i + 1))[0]
                if part == "blocks":  # `[N, K / 32, 16]` -> the format's `[N, K / 2]`
                    t = t.reshape(t.shape[0], -1)
                # GPT-OSS interleaves gate and up outputs (even, odd); the layer
                # puts all gates, then all ups.
                return t if proj == "down_proj" else _gates_then_ups(t)

            return stacked(piece)

        return tuple(
            QuantizedArray(fused(proj, "blocks"), fused(proj, "scales"), "mxfp4", dtype)
            for proj in ("gate_up_proj", "down_proj")
        )
    if quant.block != FP8_BLOCK:
        raise ValueError(
            f"quantization_config.weight_block_size={list(quant.block)}: experts are "
            f"kept quantized in blocks of {FP8_BLOCK[0]} x {FP8_BLOCK[1]} only "
            "(load with `keep_quantized=False` to dequantize them)."
        )
    names = next(
        (n for n in expert_names if f"{prefix}experts.0.{n[0]}.weight" in files), None
    )
    if names is None:
        raise ValueError(
            "`keep_quantized=True` reads FP8 experts stored one tensor per expert "
            f"and projection ({prefix}experts.0.gate_proj.weight, ...): not found."
        )

    def side_by_side(i, projs, scales):
        """Expert `i`'s projections `projs`, `[out, in]` each, transposed to
        `[in, out]` and put side by side: their bytes, or their scale grids (as
        float32 bits)."""
        pieces = []
        for proj in projs:
            name = f"{prefix}experts.{i}.{proj}.weight"
            if scales:
                pieces.append(_float32_scales(read(name + _FP8_SCALE)).T)
            else:
                pieces.append(read(name).view(np.uint8).T)
        out = np.concatenate(pieces, 1)
        return out.view(np.uint32) if scales else out

    return tuple(
        QuantizedArray(
            stacked(lambda i, p=projs: side_by_side(i, p, False)),
            stacked(lambda i, p=projs: side_by_side(i, p, True)),
            "float8_e4m3fn",
            dtype,
            parts=len(projs),
        )
        for projs in (names[:2], names[2:])
    )


def _gates_then_ups(a: np.ndarray) -> np.ndarray:
    """Rows `0, 2, 4, ...` then `1, 3, 5, ...` of `a`."""
    return np.concatenate([a[0::2], a[1::2]])


def aligned_empty(shape, dtype, alignment=64):
    """An uninitialised host array whose data starts on an `alignment`-byte boundary
    (the CPU runtime aliases only such buffers)."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(size + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + size].view(dtype).reshape(shape)
