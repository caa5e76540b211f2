"""Dequantization of the weight formats published checkpoints store their experts in:
FP8 (E4M3) with a float32 scale per block, and MXFP4 (FP4 E2M1 values, two per byte,
with an E8M0 exponent per 32 values). Pure functions of NumPy or JAX arrays (each
computes with the namespace of its input), so that a weight kept quantized in memory
can be dequantized by the same rule as one dequantized on load."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped, UInt8

# The 16 FP4 E2M1 values by their 4-bit code (the sign is the high bit).
FP4_E2M1_VALUES = (
    *(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    *(-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),
)
# Values per MXFP4 block, which share one E8M0 exponent.
MXFP4_BLOCK = 32


def _xp(x):
    return jnp if isinstance(x, jax.Array) else np


def _overflow_is_infinity():
    """NumPy's float32 overflow gives infinity, as the formats and transformers'
    dequantization do (and as JAX does, silently): not a warning."""
    return np.errstate(over="ignore", invalid="ignore")


def e8m0_to_float32(exponents: UInt8[np.ndarray | Array, "*shape"]):
    """E8M0 scales (one byte each, the float `2 ** (byte - 127)`) as float32.

    **Arguments:**

    - `exponents`: the scale bytes, `uint8`.

    **Returns:**

    The scales, float32. Byte 255 gives infinity (as transformers' dequantization
    does; the format calls it NaN, and no trained checkpoint holds it).
    """
    xp = _xp(exponents)
    with _overflow_is_infinity():
        return xp.ldexp(xp.ones((), xp.float32), exponents.astype(xp.int32) - 127)


def dequantize_fp8_blocks(
    w: Shaped[np.ndarray | Array, "*experts rows cols"],
    scale_inv: Shaped[np.ndarray | Array, "*experts row_blocks col_blocks"],
    block: tuple[int, int],
    dtype=np.float32,
) -> Float[np.ndarray | Array, "*experts rows cols"]:
    """An FP8 block-scaled weight as floats: `w` times the scale of its block.

    Blocks are `block[0] x block[1]` from the first row and column; the last block of
    each axis is partial when the block does not divide it. The product is computed
    in float32 (where it is exact) and cast to `dtype` once, as transformers'
    `Fp8Dequantize` does.

    **Arguments:**

    - `w`: the weight, `float8_e4m3fn`, `[..., rows, cols]` (`[out, in]` for a
        `torch.nn.Linear` weight).
    - `scale_inv`: the scale of each block (the checkpoints' `weight_scale_inv`),
        `[..., ceil(rows / block[0]), ceil(cols / block[1])]`: float32, or E8M0 bytes
        (`uint8`).
    - `block`: `(block rows, block columns)`, the config's `weight_block_size`.
    - `dtype`: the result's dtype.

    **Returns:**

    The weight, `dtype`, shaped as `w`. A `scale_inv` of another shape is a
    `ValueError`.
    """
    xp = _xp(w)
    rows, cols = w.shape[-2:]
    br, bc = block
    grid = (*w.shape[:-2], -(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"the block scales have shape {tuple(scale_inv.shape)}, expected {grid} "
            f"for a weight of shape {tuple(w.shape)} in blocks of {br} x {bc}."
        )
    if scale_inv.dtype == np.uint8:
        scale = e8m0_to_float32(scale_inv)
    else:
        scale = scale_inv.astype(xp.float32)
    # Each scale over its block, cut to the weight where the last block is partial.
    scale = xp.repeat(xp.repeat(scale, br, axis=-2)[..., :rows, :], bc, axis=-1)
    with _overflow_is_infinity():
        return (w.astype(xp.float32) * scale[..., :cols]).astype(dtype)


def dequantize_mxfp4(
    blocks: UInt8[np.ndarray | Array, "*rows groups 16"],
    scales: UInt8[np.ndarray | Array, "*rows groups"],
    dtype=np.float32,
) -> Float[np.ndarray | Array, "*rows values"]:
    """MXFP4 values as floats: each 4-bit E2M1 code's value times its block's
    E8M0 scale.

    Element `2 j` of a block is the low half of byte `j`, element `2 j + 1` the high
    half. The scaled value is computed in float32 (where it is exact) and cast to
    `dtype` once, as transformers' `convert_moe_packed_tensors` does.

    **Arguments:**

    - `blocks`: `uint8`, `[..., groups, 16]`: each group is one block of 32 values,
        along the last (contracting) axis of the weight.
    - `scales`: `uint8` E8M0 exponents, `[..., groups]`.
    - `dtype`: the result's dtype.

    **Returns:**

    `[..., groups * 32]`, `dtype`. Shapes that do not match are a `ValueError`.
    """
    xp = _xp(blocks)
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks of shape {tuple(blocks.shape)} and scales of shape "
            f"{tuple(scales.shape)}: expected `[..., groups, {MXFP4_BLOCK // 2}]` "
            "and `[..., groups]`."
        )
    lut = xp.asarray(FP4_E2M1_VALUES, xp.float32)
    values = xp.stack([lut[blocks & 0x0F], lut[blocks >> 4]], axis=-1)
    values = values.reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    # `ldexp` scales each value exactly (an exponent of 128 included), as
    # transformers' `torch.ldexp` does; the scale itself is never a float.
    exponents = scales.astype(xp.int32)[..., None] - 127
    with _overflow_is_infinity():
        out = xp.ldexp(values, exponents)
        return out.reshape(*scales.shape[:-1], -1).astype(dtype)
