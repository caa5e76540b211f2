"""Dequantization of the weight formats published checkpoints store their experts in:
FP8 (E4M3) with a float32 scale per block, and MXFP4 (FP4 E2M1 values, two per byte,
with an E8M0 exponent per 32 values). Pure functions of NumPy or JAX arrays (each
computes with the namespace of its input), so that a weight kept quantized in memory
can be dequantized by the same rule as one dequantized on load."""

import abc
import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Shaped, UInt8

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


def _scaled_fp4_bits(xp, code, exponent_byte):
    """The float32 bits of `FP4_E2M1_VALUES[code] * 2 ** (exponent_byte - 127)`,
    computed in integers (exactly, subnormals and overflow to infinity included, as
    `ldexp` gives them; no table lookup, a gather that an explicitly sharded array
    would need a sharding for; several times faster than `ldexp`, and float
    arithmetic on XLA:CPU flushes subnormals to zero).

    A nonzero code is `1.m * 2^u` with `u = e - 1` and mantissa bit `m` for exponent
    bits `e > 0`, or `1.0 * 2^-1` (0.5) for `e = 0, m = 1`; scaled, its exponent
    field is `f = u + byte`: `f >= 255` is infinity, `f >= 1` a normal float, and
    `f` in `{0, -1}` (the lowest bytes) a subnormal whose significand shifts right by
    `1 - f` bits, none of them lost."""
    code = code.astype(xp.int32)
    byte = exponent_byte.astype(xp.int32)
    e, m = (code >> 1) & 3, code & 1
    sign = (code & 8) << 28
    u = xp.where(e > 0, e - 1, -1)
    mantissa = xp.where(e > 0, m, 0)
    f = u + byte
    normal = (xp.clip(f, 1, 254) << 23) | (mantissa << 22)
    significand = (1 << 23) | (mantissa << 22)
    subnormal = significand >> xp.clip(1 - f, 1, 31)
    bits = xp.where(f >= 255, 255 << 23, xp.where(f >= 1, normal, subnormal))
    bits = xp.where((e == 0) & (m == 0), 0, bits) | sign
    if xp is np:
        return bits.astype(np.uint32).view(np.float32)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


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
    # Scaled exactly as transformers' `torch.ldexp` does (an exponent of 128
    # included).
    byte = scales[..., None]
    pair = [_scaled_fp4_bits(xp, blocks & 0x0F, byte)]
    pair.append(_scaled_fp4_bits(xp, blocks >> 4, byte))
    with _overflow_is_infinity():
        return xp.stack(pair, -1).reshape(*scales.shape[:-1], -1).astype(dtype)


# ---------------------------------------------------------------------------------
# Weights kept quantized in memory.


class AbstractQuantFormat(eqx.Module):
    """How a [`moe_eqx.QuantizedArray`][] stores a weight `[..., K, N]` (`[in, out]`
    per expert): the dtypes and shapes of its `values` and `scales`, and the rules
    that quantize a float weight into them and dequantize it back. Every format
    is one of these, registered under its `name` ([`moe_eqx.register_quant_format`][]);
    the built-in ones are `"int8"`, `"float8_e4m3fn"` and `"mxfp4"`.

    Subclass it with the class attributes `name`, `values_dtype` and
    `scales_dtype`, and the methods `scales_shape`, `dequantize` and `quantize`
    (`shape` and `block` have defaults for values stored `[..., K, N]`). A weight in
    a format of your own runs on every backend and path: a backend dequantizes it
    as it loads it (the TPU decode kernel and the GPU kernels read the built-in
    formats in place). For example, 4-bit integers per output channel stored one
    per byte:

    ```python
    class Int4(me.AbstractQuantFormat):
        name = "int4"
        values_dtype = np.dtype(np.int8)
        scales_dtype = np.dtype(np.float32)

        def scales_shape(self, values_shape, parts):
            return (*values_shape[:-2], 1, values_shape[-1])

        def dequantize(self, values, scales, dtype, parts):
            return (values.astype(jnp.float32) * scales).astype(dtype)

        def quantize(self, w):
            amax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
            scale = jnp.where(amax > 0, amax / 7, 1.0)
            return jnp.clip(jnp.round(w / scale), -7, 7).astype(jnp.int8), scale

    me.register_quant_format(Int4())
    ```

    (A float `scales` is then a float leaf: `eqx.filter_grad` differentiates it.
    The built-in formats store float32 scales as their `uint32` bits so that a
    quantized weight is a constant for autodiff.)
    """

    name: eqx.AbstractClassVar[str]
    values_dtype: eqx.AbstractClassVar[np.dtype]
    scales_dtype: eqx.AbstractClassVar[np.dtype]
    # Whether the columns may be stored as `parts` equal parts, each blocked alone.
    has_parts: ClassVar[bool] = False
    # The layout of `values`, for error messages.
    layout: ClassVar[str] = "`[..., K, N]`"
    # Whether `values` and `scales` are bit patterns (FP8, E8M0 bytes), which a
    # `QuantizedArray` takes in either signedness of their width and reinterprets
    # (not integers whose value is their meaning, as int8's values).
    bit_patterns: ClassVar[bool] = False

    @abc.abstractmethod
    def scales_shape(
        self, values_shape: tuple[int, ...], parts: int
    ) -> tuple[int, ...]:
        """The shape `scales` must have for `values` of `values_shape`; a
        `ValueError` naming the layout when the format cannot store such values."""

    def shape(self, values_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The logical (dequantized) shape `[..., K, N]` of `values` of this shape
        (default: the same, for values stored `[..., K, N]`)."""
        return tuple(values_shape)

    @abc.abstractmethod
    def dequantize(self, values: Array, scales: Array, dtype, parts: int) -> Array:
        """The weight `[..., K, N]` as floats in `dtype` (computed in float32 and
        rounded once)."""

    @abc.abstractmethod
    def quantize(self, w: Float[Array, "*experts k n"]) -> tuple[Array, Array]:
        """`(values, scales)` of the float32 weight `w`."""

    def block(self, axis: str) -> int:
        """The width of the scale blocks along `axis` (`"k"` or `"n"`): a split of
        that axis over devices must keep whole blocks (default 1: any split)."""
        return 1

    def partition_specs(self, lead: tuple, k, n) -> tuple[tuple, tuple]:
        """The partition-spec entries of `values` and `scales` for a weight whose
        `[..., K, N]` is split as `(*lead, k, n)` (default: both laid out
        `[..., K, N]` and split alike, the scales with their blocks)."""
        return (*lead, k, n), (*lead, k, n)


_FORMATS: dict[str, AbstractQuantFormat] = {}


def register_quant_format(fmt: AbstractQuantFormat) -> AbstractQuantFormat:
    """Makes `fmt` available by its name to [`moe_eqx.QuantizedArray`][],
    [`moe_eqx.quantize_experts`][] and `moe_eqx.internal.quantize`. Registering
    another object under a name already taken is a `ValueError` (the same object
    again is not).

    **Arguments:**

    - `fmt`: an instance of a subclass of [`moe_eqx.AbstractQuantFormat`][].

    **Returns:**

    `fmt`.
    """
    if not isinstance(fmt, AbstractQuantFormat):
        raise TypeError(
            f"`register_quant_format` takes an `AbstractQuantFormat` instance, got "
            f"{type(fmt).__name__}."
        )
    name = fmt.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"A format's `name` must be a non-empty str, got {name!r}.")
    taken = _FORMATS.get(name)
    if taken is not None and taken != fmt:
        raise ValueError(
            f"The quantized format name {name!r} is taken by {type(taken).__name__}."
        )
    _FORMATS[name] = fmt
    return fmt


def quant_formats() -> tuple[str, ...]:
    """The names of the registered quantized formats."""
    return tuple(_FORMATS)


def quant_format(fmt: "str | AbstractQuantFormat") -> AbstractQuantFormat:
    """The registered format named `fmt` (or `fmt` itself, registered); an unknown
    name is a `ValueError` listing the known ones."""
    if isinstance(fmt, AbstractQuantFormat):
        return register_quant_format(fmt)
    found = _FORMATS.get(fmt) if isinstance(fmt, str) else None
    if found is None:
        raise ValueError(
            f"Unknown quantized format `fmt` {fmt!r}; expected one of "
            f"{quant_formats()} (or a format of your own, `me.register_quant_format`)."
        )
    return found


# FP8 blocks of DeepSeek-V3's published checkpoints: rows x columns of `[in, out]`.
FP8_BLOCK = (128, 128)


def _bits(a: Array | np.ndarray, dtype) -> Array:
    return jax.lax.bitcast_convert_type(jnp.asarray(a), dtype)


def _as_stored(a, want):
    """`a` reinterpreted as `want` when it holds integers of the same width and the
    other signedness (a bitcast: the same bytes); else `a` as it is."""
    dtype = getattr(a, "dtype", None)
    want = np.dtype(want)
    if (
        dtype is None
        or np.dtype(dtype) == want
        or want.kind not in "iu"
        or np.dtype(dtype).kind not in "iu"
        or np.dtype(dtype).itemsize != want.itemsize
    ):
        return a
    if isinstance(a, np.ndarray):
        return a.view(want)
    return jax.lax.bitcast_convert_type(a, want)


class QuantizedArray(eqx.Module):
    """A weight `[..., K, N]` (`[in, out]` per expert) stored quantized: integer
    arrays only, so autodiff (`eqx.filter_grad`, `jax.grad` with `allow_int`) treats
    it as a constant. Its leading axes (the experts) index, slice, shard and move
    like a float array's; the backends dequantize what they load.

    `fmt` names its [`moe_eqx.AbstractQuantFormat`][], which says how `values` and
    `scales` hold the weight: the built-in `"float8_e4m3fn"` (128 x 128 blocks,
    DeepSeek-V3's), `"mxfp4"` (values `[..., N, K / 2]`, gpt-oss's) and
    `"int8"` (a scale per output channel), or one of your own
    ([`moe_eqx.register_quant_format`][]).

    The float32 scales are stored as their bits (`uint32`) so that no leaf is a
    float array: `eqx.filter_grad` and optimizers skip the whole weight.

    **Fields:**

    - `values`, `scales`: as above.
    - `fmt`: the name of a registered format (static).
    - `dtype`: the dtype `dequantize` returns by default (static).
    - `parts`: formats with `has_parts` (FP8) only: the columns are this many
        equal parts, each blocked from its own first column (a gate and an up
        projection stored apart and put side by side, whose width the block need
        not divide).
    """

    values: Array
    scales: Array
    fmt: str = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True, converter=np.dtype)
    parts: int = eqx.field(static=True, default=1)

    def __init__(self, values, scales, fmt: str, dtype, parts: int = 1):
        # Bytes of the other signedness than the format stores (`uint8` where it
        # stores `int8`, as checkpoints hold them) are reinterpreted, not converted.
        found = _FORMATS.get(fmt)
        if found is not None and found.bit_patterns:
            values = _as_stored(values, found.values_dtype)
            scales = _as_stored(scales, found.scales_dtype)
        self.values, self.scales, self.fmt = values, scales, fmt
        self.dtype, self.parts = np.dtype(dtype), parts

    def __check_init__(self):
        fmt = quant_format(self.fmt)
        if self.parts != 1 and not fmt.has_parts:
            raise ValueError(
                f"`parts` applies to formats stored in parts only, not {self.fmt!r}."
            )
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise ValueError(
                f"`QuantizedArray.dtype` must be a floating-point dtype, got "
                f"{self.dtype}."
            )
        if not (hasattr(self.values, "shape") and hasattr(self.scales, "shape")):
            return  # a tree of other leaves (specs, tangents): not an array's
        for name, want in (
            ("values", np.dtype(fmt.values_dtype)),
            ("scales", np.dtype(fmt.scales_dtype)),
        ):
            got = getattr(self, name).dtype
            if got != want:
                raise ValueError(
                    f"`QuantizedArray.{name}` of format {self.fmt!r} must be {want}, "
                    f"got {got}."
                )
        expected = tuple(fmt.scales_shape(tuple(self.values.shape), self.parts))
        if tuple(self.scales.shape) != expected:
            raise ValueError(
                f"`QuantizedArray.scales` of format {self.fmt!r} must have shape "
                f"{expected} for values of shape {tuple(self.values.shape)}, got "
                f"{tuple(self.scales.shape)} (values are {fmt.layout})."
            )

    @property
    def format(self) -> AbstractQuantFormat:
        """The [`moe_eqx.AbstractQuantFormat`][] named by `fmt`."""
        return quant_format(self.fmt)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape `[..., K, N]`."""
        return tuple(self.format.shape(tuple(self.values.shape)))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of `values` and `scales` together."""
        return self.values.nbytes + self.scales.nbytes

    def astype(self, dtype) -> "QuantizedArray":
        """The same weight, dequantizing to `dtype`."""
        return dataclasses.replace(self, dtype=dtype)

    def __getitem__(self, index) -> "QuantizedArray":
        """Indexes the leading (expert) axes of `values` and `scales` alike: an int, a
        slice or an integer array per leading axis, at most as many as there are
        (the weight's own `[K, N]` axes cannot be indexed: they are laid out
        differently in each format). Anything else is a `ValueError`."""
        lead = self.ndim - 2
        entries = index if isinstance(index, tuple) else (index,)
        for entry in entries:
            ok = (
                isinstance(entry, int | slice | np.integer)
                and not isinstance(entry, bool)
            ) or (hasattr(entry, "dtype") and jnp.issubdtype(entry.dtype, jnp.integer))
            if not ok:
                raise ValueError(
                    f"`QuantizedArray` indexes its leading (expert) axes with ints, "
                    f"slices or integer arrays only, got {entry!r}."
                )
        if len(entries) > lead:
            raise ValueError(
                f"`QuantizedArray` of shape {self.shape} indexes its {lead} leading "
                f"(expert) axes only, got an index of {len(entries)}: its own "
                "`[K, N]` axes are stored in the format's layout."
            )
        return self.map_experts(lambda a: a[index])

    def map_experts(self, fn) -> "QuantizedArray":
        """`fn` applied to `values` and `scales`; `fn` may only act on leading axes
        above the weight's own two."""
        return dataclasses.replace(self, values=fn(self.values), scales=fn(self.scales))

    def dequantize(self, dtype=None) -> Array:
        """The weight as floats, `[..., K, N]`: computed in float32 and cast to
        `dtype` (default `self.dtype`) once.

        **Arguments:**

        - `dtype`: the result's dtype.

        **Returns:**

        The weight, as the format defines it (bitwise equal to transformers'
        dequantization for FP8 and MXFP4).
        """
        dtype = self.dtype if dtype is None else dtype
        return self.format.dequantize(self.values, self.scales, dtype, self.parts)


def _mxfp4_in_out(values, scales, dtype) -> Array:
    """The MXFP4 weight of `values` `[..., N, K / 2]` and `scales` `[..., N, K / 32]`
    (`moe_eqx.internal.MXFP4`) as `[..., K, N]`, exactly (`dequantize_mxfp4`'s
    values, transposed): the bytes moved into that order first (a quarter of the
    float output's bytes).

    Each byte is read twice along `K` (its low half at the even row, its high half
    at the odd one), so every intermediate has the weight's own `[..., K, N]` shape:
    no axis of two codes or of the 16 bytes of a block is ever the minor one (on a
    TPU such an axis is padded to 128 lanes; docs/measured.md, "TPU"). A code's E2M1 value is computed arithmetically
    (`_fp4_value`), and a scale byte `s` in `[2, 254]` is the float32 `2 ** (s -
    127)` by its bits, so one multiplication gives exactly what `ldexp` gives (a
    normal float, or infinity past the largest). Only the lowest bytes (subnormal
    results, which float arithmetic on XLA:CPU flushes to zero) and the highest
    (`2 ** 128` is no float32) need the integer construction of `_scaled_fp4_bits`:
    a `lax.cond` takes it when any scale byte is one of those, which no trained
    checkpoint has. Each branch casts to `dtype` itself, so the float32 values are
    never held whole.
    """
    *lead, n, half_k = values.shape
    blocks = jnp.swapaxes(values, -1, -2)  # [..., K / 2, N]
    blocks = blocks.reshape(*lead, half_k // (MXFP4_BLOCK // 2), MXFP4_BLOCK // 2, n)
    byte = jnp.moveaxis(scales, -2, -1)[..., None, :]  # [..., K / 32, 1, N]

    def codes(blocks):
        twice = jnp.repeat(blocks, 2, axis=-2)  # [..., K / 32, 32, N]
        odd = jax.lax.broadcasted_iota(jnp.int32, twice.shape, twice.ndim - 2) & 1
        return jnp.where(odd == 1, twice >> 4, twice & 0x0F).astype(jnp.int32)

    def in_rows(values):  # [..., K / 32, 32, N] -> [..., K, N]
        values = values.reshape(*values.shape[:-3], -1, values.shape[-1])
        return values.astype(dtype)

    def by_float(blocks, byte):
        scale = jax.lax.bitcast_convert_type(byte.astype(jnp.uint32) << 23, jnp.float32)
        return in_rows(fp4_value(codes(blocks)) * scale)

    def by_bits(blocks, byte):
        return in_rows(_scaled_fp4_bits(jnp, codes(blocks), byte))

    lo, hi = NORMAL_SCALE_BYTES
    edge = jnp.any((scales < lo) | (scales > hi))
    return jax.lax.cond(edge, by_bits, by_float, blocks, byte)


def fp4_value(code: Int[Array, "*shape"]) -> Float[Array, "*shape"]:
    """The float32 value of each FP4 E2M1 code (`0 <= code < 16`), exactly, by
    arithmetic: `(2 [e > 0] + m) * 2 ** (max(e, 1) - 2)` for exponent bits `e` and
    mantissa bit `m`, negative with the sign bit (code 8 is -0.0)."""
    e, m = (code >> 1) & 3, code & 1
    mantissa = (jnp.where(e > 0, 2, 0) + m).astype(jnp.float32)
    scale = jnp.where(e == 3, 2.0, jnp.where(e == 2, 1.0, 0.5)).astype(jnp.float32)
    value = mantissa * scale
    return jnp.where((code & 8) != 0, -value, value)


# The scale bytes for which `code * 2 ** (byte - 127)` is a normal float32 or an
# overflow to infinity for every code, so that a float32 multiplication is exact.
NORMAL_SCALE_BYTES = (2, 254)


def quantize(
    w: Float[Array, "*experts k n"], fmt: "str | AbstractQuantFormat"
) -> QuantizedArray:
    """Quantizes a weight `[..., K, N]` (`[in, out]`) into `fmt` (each format's
    rule is on its class: `"int8"` [`moe_eqx.internal.Int8`][],
    `"float8_e4m3fn"` [`moe_eqx.internal.FP8Blocks`][], `"mxfp4"`
    [`moe_eqx.internal.MXFP4`][]).

    **Arguments:**

    - `w`: the float weight.
    - `fmt`: a registered format's name, or an [`moe_eqx.AbstractQuantFormat`][]
        (registered by this call).

    **Returns:**

    A [`moe_eqx.QuantizedArray`][] that dequantizes to `w.dtype`.
    """
    fmt = quant_format(fmt)
    values, scales = fmt.quantize(jnp.asarray(w).astype(jnp.float32))
    return QuantizedArray(values, scales, fmt.name, w.dtype)


class QuantizedWithBias(eqx.Module):
    """A quantized expert weight `[E, K, N]` with a per-expert bias `[E, N]` folded in
    as one more row, and with `one_column` one more column carrying a constant 1
    (`[0, ..., 0, 1]`): `[E, K + 1, N + one_column]`, the layout of
    `moe_eqx.internal.fold_biases`, built only where an expert is loaded (one at a
    time) instead of as a float copy of every expert. The bias is a float array: it
    gets its gradient through `dequantize`, the quantized part none.

    **Fields:**

    - `weight`: the [`moe_eqx.QuantizedArray`][].
    - `bias`: `[E, N]`, floating point.
    - `one_column`: append the column that carries the 1 (the first projection's).
    """

    weight: QuantizedArray
    bias: Array
    one_column: bool = eqx.field(static=True)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, k, n = self.weight.shape
        return (*lead, k + 1, n + int(self.one_column))

    @property
    def dtype(self) -> np.dtype:
        return self.weight.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.bias.nbytes

    def map_experts(self, fn) -> "QuantizedWithBias":
        """`fn` applied to the weight's arrays and to the bias alike (leading axes
        only)."""
        return dataclasses.replace(
            self, weight=self.weight.map_experts(fn), bias=fn(self.bias)
        )

    def dequantize(self, dtype=None) -> Array:
        """The folded weight as floats, `[..., K + 1, N + one_column]`."""
        dtype = self.dtype if dtype is None else dtype
        w = self.weight.dequantize(dtype)
        w = jnp.concatenate([w, self.bias[..., None, :].astype(dtype)], axis=-2)
        if not self.one_column:
            return w
        column = jnp.zeros((*w.shape[:-1], 1), dtype).at[..., -1, :].set(1)
        return jnp.concatenate([w, column], axis=-1)


# A weight the backends take: floats, or stored quantized (with its bias, folded).
QuantizedWeight = QuantizedArray | QuantizedWithBias


def is_quantized(w) -> bool:
    """`w` is stored quantized (dequantized where a backend loads it)."""
    return isinstance(w, QuantizedArray | QuantizedWithBias)


def as_float(w, dtype) -> Array:
    """`w` in `dtype`: a quantized weight ([`moe_eqx.QuantizedArray`][], or one with
    its bias folded in) dequantized to its own `dtype`, as the float weight it stands
    for, then cast (the same values in every compute dtype); a float array cast."""
    if is_quantized(w):
        return w.dequantize(w.dtype).astype(dtype)
    return w.astype(dtype)
