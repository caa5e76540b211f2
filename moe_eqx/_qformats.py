"""The built-in quantized formats ([`moe_eqx.AbstractQuantFormat`][]), each one class:
its stored dtypes and shapes, its quantization and its dequantization, registered
under its name when the package is imported. A format of your own is a subclass in a
file of your own and one `moe_eqx.register_quant_format` call."""

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ._quant import (
    FP8_BLOCK,
    MXFP4_BLOCK,
    AbstractQuantFormat,
    _bits,
    _mxfp4_in_out,
    dequantize_fp8_blocks,
    register_quant_format,
)

_FP8_MAX = 448.0
_INT8_MAX = 127.0


def _k_n(values_shape, fmt: str):
    if len(values_shape) < 2:
        raise ValueError(
            f"`QuantizedArray.values` of format {fmt!r} must be `[..., K, N]`, got "
            f"shape {tuple(values_shape)}."
        )
    return values_shape[-2:]


class Int8(AbstractQuantFormat):
    """`"int8"`: `values` `int8` `[..., K, N]`; `scales` `uint32` `[..., 1, N]`,
    the bits of one float32 scale per output channel, `amax / 127` (1 for a zero
    column); `values = round(w / scale)`."""

    name: ClassVar[str] = "int8"
    values_dtype: ClassVar[np.dtype] = np.dtype(np.int8)
    scales_dtype: ClassVar[np.dtype] = np.dtype(np.uint32)

    def scales_shape(self, values_shape, parts):
        _, n = _k_n(values_shape, self.name)
        return (*values_shape[:-2], 1, n)

    def dequantize(self, values, scales, dtype, parts):
        scale = _bits(scales, jnp.float32)
        return (values.astype(jnp.float32) * scale).astype(dtype)

    def quantize(self, w):
        return _quantize_int8(w)

    def partition_specs(self, lead, k, n):
        return (*lead, k, n), (*lead, None, n)  # one scale row


class FP8Blocks(AbstractQuantFormat):
    """`"float8_e4m3fn"`: `values` `int8` `[..., K, N]`, the FP8 E4M3 bit
    patterns (bytes as `int8`, the TPU kernels' byte type; `uint8` bytes are
    reinterpreted on construction); `scales` `uint32` `[..., ceil(K / 128), ceil(N / 128)]`, the bits of
    one float32 scale per 128 x 128 block (DeepSeek-V3's `weight_scale_inv`),
    `amax / 448` (1 for a zero block); values rounded to nearest even. Stored in
    `parts` (a gate and an up projection side by side), each part is blocked from
    its own first column."""

    name: ClassVar[str] = "float8_e4m3fn"
    values_dtype: ClassVar[np.dtype] = np.dtype(np.int8)
    scales_dtype: ClassVar[np.dtype] = np.dtype(np.uint32)
    has_parts: ClassVar[bool] = True
    bit_patterns: ClassVar[bool] = True

    def scales_shape(self, values_shape, parts):
        k, n = _k_n(values_shape, self.name)
        if n % parts:
            raise ValueError(
                f"`QuantizedArray.parts` ({parts}) must divide the {n} columns."
            )
        blocks = -(-(n // parts) // FP8_BLOCK[1]) * parts
        return (*values_shape[:-2], -(-k // FP8_BLOCK[0]), blocks)

    def dequantize(self, values, scales, dtype, parts):
        w = _bits(values, jnp.float8_e4m3fn)
        scale = _bits(scales, jnp.float32)
        if parts == 1:
            return dequantize_fp8_blocks(w, scale, FP8_BLOCK, dtype)
        pieces = zip(
            jnp.split(w, parts, axis=-1), jnp.split(scale, parts, axis=-1), strict=True
        )
        return jnp.concatenate(
            [dequantize_fp8_blocks(v, s, FP8_BLOCK, dtype) for v, s in pieces], -1
        )

    def quantize(self, w):
        return _quantize_fp8(w)

    def block(self, axis):
        return FP8_BLOCK[0] if axis == "k" else FP8_BLOCK[1]


class MXFP4(AbstractQuantFormat):
    """`"mxfp4"`: `values` `[..., N, K / 2]`, two FP4 E2M1 codes per byte
    (byte `j` of row `n`: `K = 2 j` in its low half, `2 j + 1` in its high half),
    blocks of 32 along the contracting axis `K`, which it must divide; `scales`
    `[..., N, K / 32]`, E8M0 exponents (both bytes as `int8`, the TPU kernels' byte
    type; `uint8` bytes are reinterpreted on construction), the OCP MX scale
    `2 ** (floor(log2(amax)) - 2)`; each code the E2M1 value nearest `w / scale`
    (ties to an even code), saturating at 6. gpt-oss's `*_blocks`
    `[..., N, K / 32, 16]` are these bytes: `blocks.reshape(*blocks.shape[:-2], -1)`.
    (No axis of 16 bytes: a TPU pads a minor axis to 128 lanes.)"""

    name: ClassVar[str] = "mxfp4"
    values_dtype: ClassVar[np.dtype] = np.dtype(np.int8)
    scales_dtype: ClassVar[np.dtype] = np.dtype(np.int8)
    bit_patterns: ClassVar[bool] = True
    layout: ClassVar[str] = (
        "`[..., N, K / 2]`: gpt-oss's `*_blocks` `[..., N, K / 32, 16]` reshape them "
        "to `[..., N, K / 2]`"
    )

    def scales_shape(self, values_shape, parts):
        half = MXFP4_BLOCK // 2
        if len(values_shape) < 2 or values_shape[-1] % half:
            raise ValueError(
                f"`QuantizedArray.values` of format {self.name!r} must be "
                f"`[..., N, K / 2]` with K a multiple of {MXFP4_BLOCK}, got shape "
                f"{tuple(values_shape)} ({self.layout})."
            )
        return (*values_shape[:-1], values_shape[-1] // half)

    def shape(self, values_shape):
        return (*values_shape[:-2], values_shape[-1] * 2, values_shape[-2])

    def dequantize(self, values, scales, dtype, parts):
        return _mxfp4_in_out(_bits(values, jnp.uint8), _bits(scales, jnp.uint8), dtype)

    def quantize(self, w):
        k = w.shape[-2]
        if k % MXFP4_BLOCK:
            raise ValueError(
                f"MXFP4 blocks of {MXFP4_BLOCK} run along the contracting axis, "
                f"which has {k} values here: it must be a multiple of {MXFP4_BLOCK}."
            )
        return _quantize_mxfp4(w)

    def block(self, axis):
        return MXFP4_BLOCK if axis == "k" else 1

    def partition_specs(self, lead, k, n):
        return (*lead, n, k), (*lead, n, k)  # both `[..., N, K / ...]`


# Each a jitted function: one program per shape, not one per operation.
@jax.jit
def _quantize_int8(w):
    amax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
    scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
    values = jnp.clip(jnp.round(w / scale), -_INT8_MAX, _INT8_MAX)
    return values.astype(jnp.int8), _bits(scale, jnp.uint32)


@jax.jit
def _quantize_fp8(w):
    *lead, k, n = w.shape
    br, bc = FP8_BLOCK
    kb, nb = -(-k // br), -(-n // bc)
    padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, kb * br - k), (0, nb * bc - n)])
    blocks = padded.reshape(*lead, kb, br, nb, bc)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / _FP8_MAX, 1.0)
    full = jnp.repeat(jnp.repeat(scale, br, axis=-2)[..., :k, :], bc, axis=-1)
    q = jnp.clip(w / full[..., :n], -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
    return _bits(q, jnp.int8), _bits(scale, jnp.uint32)


# Rounding a magnitude to the nearest E2M1 value, ties to the even code: the code is
# the number of these midpoints it passes, passing `>` where the lower code is even
# (a tie stays there) and `>=` where it is odd (a tie goes up).
_FP4_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


@jax.jit
def _quantize_mxfp4(w):
    *lead, k, n = w.shape
    # Blocks of 32 along K with N the minor axis throughout (on a TPU a minor axis of
    # 32 codes or of 2 would be padded to 128 lanes); the stored layout at the end.
    blocks = w.reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK, n)
    amax = jnp.max(jnp.abs(blocks), axis=-2)  # [..., K / 32, N]
    # floor(log2(amax)) exactly, from the float's exponent (`frexp`: amax = m 2^e,
    # m in [0.5, 1)); E2M1's largest exponent is 2.
    exponent = jnp.frexp(amax)[1] - 1 - 2
    exponent = jnp.where(amax > 0, exponent, -127)
    byte = jnp.clip(exponent + 127, 0, 254)
    scaled = jnp.ldexp(blocks, (127 - byte)[..., None, :])
    magnitude = jnp.abs(scaled)
    code = sum(
        ((magnitude >= mid) if up else (magnitude > mid)).astype(jnp.int32)
        for mid, up in _FP4_MIDPOINTS
    )
    code = code + jnp.where(jnp.signbit(scaled) & (code > 0), 8, 0)
    code = code.astype(jnp.uint8)
    packed = code[..., 0::2, :] | (code[..., 1::2, :] << 4)  # [..., K / 32, 16, N]
    packed = packed.reshape(*lead, k // 2, n)  # [..., K / 2, N]
    byte = byte.astype(jnp.uint8)
    return _bits(jnp.swapaxes(packed, -1, -2), jnp.int8), _bits(
        jnp.swapaxes(byte, -1, -2), jnp.int8
    )


for _fmt in (Int8(), FP8Blocks(), MXFP4()):
    register_quant_format(_fmt)
