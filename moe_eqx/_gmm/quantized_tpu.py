"""Quantized weight tiles dequantized inside TPU kernels (Pallas), shared by the
decode kernel (`moe_eqx._gmm.pallas_tpu`) and the many-row grouped kernel
(`moe_eqx._gmm.grouped_tpu`).

Each built-in format's tile is dequantized exactly as
[`moe_eqx.QuantizedArray.dequantize`][] does: float32 values times float32 scales,
one rounding to the activations' dtype. The stored bytes are read as `int8` (a
bitcast of them outside the kernel would be a copy of every expert's weight on a
TPU) and widened to int32 in VMEM; the float values are built from their bits with
integer and float32 operations a TPU's vector unit has.
"""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Layout
from jaxtyping import Array

from .._quant import MXFP4_BLOCK, QuantizedArray, is_quantized
from .mosaic_gpu.quantized import kernel_operands


def _int32(bits: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    return int(np.array(bits, np.uint32).view(np.int32))


_INT_MIN = -(2**31)  # the float32 sign bit, as an int32
_NIBBLE_TOPS = _int32(0x88888888)  # the top bit of each 4-bit field of a word
_HALF_TOPS = _int32(0x80008000)  # the top bit of each 16-bit half
# FP4 E2M1 magnitudes (codes 0..7) times two, one per nibble: 0 1 2 3 4 6 8 12.
_FP4_TWICE = _int32(0xC8643210)

# The formats the kernels read in place; a weight in another (a user's own) is
# dequantized first.
KERNEL_FORMATS = ("int8", "float8_e4m3fn", "mxfp4")


def in_kernel(w) -> bool:
    """Whether the kernels take `w` as it is: a float array, or a `QuantizedArray`
    in one of `KERNEL_FORMATS` (MXFP4 with normal scale bytes only, which the
    caller checks), not one with its bias folded in."""
    if not is_quantized(w):
        return True
    return isinstance(w, QuantizedArray) and w.fmt in KERNEL_FORMATS


def fp8_value(b: Array) -> Array:
    """float32 values of FP8 E4M3FN bytes (`int8` widened to int32), exactly:
    normals by their float32 bits (exponent `e + 120`), subnormals `m * 2 ** -9`
    (no float32 subnormal is formed, which a TPU would flush), `0x7F` / `0xFF` NaN."""
    a = b & 0x7F
    normal = jax.lax.bitcast_convert_type((a << 20) + (120 << 23), jnp.float32)
    small = a.astype(jnp.float32) * jnp.float32(2.0**-9)
    magnitude = jnp.where(a < 8, small, normal)
    bits = jax.lax.bitcast_convert_type(magnitude, jnp.int32) | (b & _INT_MIN)
    value = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(a == 0x7F, jnp.float32(jnp.nan), value)


def fp4_pair(b: Array, scale: Array) -> tuple[Array, Array]:
    """float32 values of the low and high FP4 E2M1 codes of bytes `b` (`int8`
    widened to int32) times `scale`, where `scale` is half the block's E8M0 scale
    (`2 ** (byte - 128)`): each code's magnitude times two is a small integer
    (read from `_FP4_TWICE`), exact in float32, and so is its product with a power
    of two; the sign is the code's top bit."""

    def value(index, sign):
        twice = (jnp.int32(_FP4_TWICE) >> index) & 0xF
        product = twice.astype(jnp.float32) * scale
        bits = jax.lax.bitcast_convert_type(product, jnp.int32) | sign
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    low = value((b << 2) & 0x1C, (b << 28) & _INT_MIN)
    high = value((b >> 2) & 0x1C, b & _INT_MIN)
    return low, high


def mxfp4_half_scales(
    s: Array, width: int, product, *, rows_first: bool = False, first: int = 0
) -> Array:
    """Half of each MXFP4 block's scale, `2 ** (byte - 128)` (a normal float32 for
    the bytes the kernels take), spread over the value bytes of its block: for
    scale bytes `s` `[rows, K / 32]` (`int8`) over the `width = K / 2` value bytes
    of their rows, `[rows, K / 2]`; with `rows_first`, `s` `[K / 32, columns]` over
    the value bytes `first : first + width` of each column, `[width, columns]` (the
    transposed orientation, `mxfp4_operands`). A product
    (by `product(a, b)`, a kernel's matrix product) with a 0/1 matrix, exact (a
    power of two times one, summed with zeros)."""
    exponent = ((s.astype(jnp.int32) & 0xFF) - 1) << 23
    scale = jax.lax.bitcast_convert_type(exponent, jnp.float32).astype(jnp.bfloat16)
    half = MXFP4_BLOCK // 2
    blocks = scale.shape[0 if rows_first else 1]
    shape = (width, blocks) if rows_first else (blocks, width)
    axis = 0 if rows_first else 1  # the value bytes'
    spread = spread_matrix(shape, axis, half.bit_length() - 1, first=first)
    return product(spread, scale) if rows_first else product(scale, spread)


def spread_matrix(shape, axis: int, shift: int, *, first=0) -> Array:
    """A 0/1 bfloat16 matrix of `shape` (2-D) that spreads each entry along the
    other axis over `2 ** shift` entries along `axis`: one where the index along
    `axis` (plus `first`), shifted right by `shift`, is the index along the other.
    (`>>`, not `//`: Mosaic lowers no integer floor division.)"""
    index = jax.lax.broadcasted_iota(jnp.int32, shape, axis) + first
    other = jax.lax.broadcasted_iota(jnp.int32, shape, 1 - axis)
    return jnp.where((index >> shift) == other, 1.0, 0.0).astype(jnp.bfloat16)


def bfloat16_pairs(low: Array, high: Array) -> Array:
    """The bfloat16 bits of `low` and `high` (float32 values exact in bfloat16, such
    as FP4 codes times power-of-two scales) in the low and high halves of one int32
    word each: `pltpu.bitcast` of `[r, c]` words to bfloat16 is `[2 r, c]`, row
    `2 i` from `low[i]` and `2 i + 1` from `high[i]`."""

    def bits(x):
        return jax.lax.bitcast_convert_type(x, jnp.int32)

    return ((bits(low) >> 16) & 0xFFFF) | (bits(high) & -(1 << 16))


def fp4_bfloat16_words(
    words: Array, scales: list[Array], *, halves: bool
) -> list[Array]:
    """The bfloat16 bits of MXFP4 values, two to an int32 word, built by integer
    operations on whole words (no float arithmetic, eight codes per input word):
    the dequantization of the decode kernel.

    `words` (int32) hold eight FP4 E2M1 codes each, code `t` in bits `4 t` to
    `4 t + 3`. Returns four arrays of words: word `s` holds code `s` in its low
    half and code `s + 4` in its high half, each times its block's scale `2 **
    (byte - 127)`. `scales[s]` (int32, as `words`) gives word `s`'s
    `(byte - 1) << 7`: one value for both halves (`halves` false), or each half's
    own in that half (`halves`: `(low - 1) << 7 | (high - 1) << 23`).

    A code of magnitude `c = 2 e + m >= 2` is `2 ** (e - 1) (1 + m / 2)`: its
    bits are `(c << 6) + ((byte - 1) << 7)` (exponent field `e - 1 + byte`, the
    mantissa's top bit `m`); magnitude 1 (0.5, E2M1's subnormal) is the scale's
    bits alone; magnitude 0 is zero. Exact for scale bytes in `[2, 252]`, where
    every value is a normal bfloat16 (`DECODE_SCALE_BYTES`)."""
    srl = jax.lax.shift_right_logical
    magnitude = words & 0x77777777
    # Each field's top bit: magnitude at least 1, at least 2 (no carry leaves a
    # field: 7 + 7 < 16).
    nonzero = (magnitude + 0x77777777) & _NIBBLE_TOPS
    normal = (magnitude + 0x66666666) & _NIBBLE_TOPS
    magnitude = magnitude - srl(nonzero ^ normal, 3)  # 1 -> 0
    signs = words & _NIBBLE_TOPS
    out = []
    for s, scale in enumerate(scales):
        on = srl(nonzero, 4 * s + 3) & 0x00010001  # 1 in each nonzero half
        # (One value below 2 ** 16 times 0/1 halves stays in each half; each
        # half's own is kept by a mask of its bits 7 to 14.)
        scale = (on * 0x7F80) & scale if halves else scale * on
        # The halves' magnitudes moved to bits 6 to 8 (one shift each way).
        move = 6 - 4 * s
        bits = magnitude << move if move >= 0 else srl(magnitude, -move)
        bits = bits & 0x01C001C0
        out.append((bits + scale) | ((signs << (12 - 4 * s)) & _HALF_TOPS))
    return out


# The MXFP4 scale bytes `fp4_bfloat16_words` takes: every code times `2 ** (byte -
# 127)` a normal bfloat16 (a byte of 253 or 254 overflows some codes to infinity,
# which its exponent arithmetic cannot form).
DECODE_SCALE_BYTES = (2, 252)


@ft.lru_cache(maxsize=1024)
def _default_minor_axis(shape: tuple[int, ...], dtype: str) -> int:
    device = jax.devices()[0]
    try:
        layout = device.client.get_default_layout(jnp.dtype(dtype), shape, device)
        return Layout.from_pjrt_layout(layout).major_to_minor[-1]
    except Exception:  # a platform or version without the query: row-major
        return len(shape) - 1


def stores_transposed(shape: tuple[int, ...], dtype) -> bool:
    """Whether the default platform's own layout of an array of `shape` and `dtype`
    (the layout a call's array arguments arrive in) has its second-to-last axis
    minor-most. A TPU chooses that for an array whose last axis is not a multiple
    of 128 lanes and whose second-to-last is (an MXFP4 weight's `[..., N, K / 2]`
    bytes with `K / 2 = 704`, say); row-major elsewhere."""
    if len(shape) < 2:
        return False
    return _default_minor_axis(tuple(shape), jnp.dtype(dtype).name) == len(shape) - 2


def mxfp4_operands(w: QuantizedArray) -> tuple[Array, bool]:
    """`(values, kn)`: an MXFP4 weight's stored value bytes as a kernel reads
    them, `[G, N, K / 2]` (`kn` false), or with their last two axes swapped,
    `[G, K / 2, N]` (`kn` true), where they arrive in a layout with `N`
    minor-most (`stores_transposed`): the swapped view is then the bytes as they
    lie, and a kernel reading it row-major makes no copy of them (the stored
    orientation would be one in every call). A kernel reads the scales in the
    same orientation (the many-row kernel: `jnp.swapaxes(w.scales, -1, -2)`, a
    copy of them alone, a sixteenth of the bytes, where their own layout
    differs; the decode kernel: its touched experts' only)."""
    values = w.values
    if stores_transposed(values.shape, values.dtype):
        return jnp.swapaxes(values, -1, -2), True
    return values, False


def column_scales(w: QuantizedArray, k: int, n: int) -> Array:
    """An int8 or FP8 weight's float32 scales, one column per weight column: int8's
    `[G, 1, N]`, FP8's `[G, ceil(K / 128), N]` (one row per 128-row block, each
    part blocked from its own first column)."""
    return kernel_operands(w, k, n)[1]


def dequantize_rows(fmt: str, dtype, values: Array, scales: Array) -> Array:
    """Rows of an int8 or FP8 tile dequantized to `dtype`: `values` `[r, n]`
    (`int8` bytes), `scales` `[1, n]` float32 (int8: the columns' scales; FP8: the
    columns' scales in the rows' 128-row block)."""
    codes = values.astype(jnp.int32)
    if fmt == "int8":
        value = codes.astype(jnp.float32)
    else:
        value = fp8_value(codes)
    return (value * scales).astype(dtype)
