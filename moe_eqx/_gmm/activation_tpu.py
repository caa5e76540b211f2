"""A gated activation's backward on TPUs as one Pallas pass.

Between the experts' two products the backward forms the cotangent of the first
product `h = [gate | up]` (`[rows, 2 d_ff]`) from the cotangent of the hidden units
(`[rows, d_ff]`). XLA:TPU computes the two halves' cotangents in one pass and
concatenates them in a second, which reads and writes all of `h`'s cotangent once
more (`pad_maximum` in a profile: as long as the first pass). Here one kernel reads
a tile of rows of `h` and of the cotangent and writes both halves of that tile's
result: the same float32 arithmetic, `jax.vjp` of the activation on each half, each
rounded to `h`'s dtype.

Only the library's own gated activations are taken (`KERNEL_ACTIVATIONS`, by exact
type: Mosaic lowers the operations they use; the exact GELU's `erfc` it does not),
with halves of a whole number of 128-lane columns; anything else goes through JAX's
own vjp of the two halves. Derivatives of
the kernel (second order) are JAX's own of the same formula.
"""

import functools as ft

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from .._activation import (
    AbstractActivation,
    ClampedSwiGLU,
    GeGLU,
    SoftcapSwiGLU,
    SwiGLU,
    halves_cotangent,
    halves_vjp,
)

# The activations the kernel computes (exact types: a subclass may call anything).
KERNEL_ACTIVATIONS = (SwiGLU, GeGLU, ClampedSwiGLU, SoftcapSwiGLU)
# VMEM for a step's tiles and their float32 temporaries, and the limit asked for.
_TILE_BYTES = 24 << 20
_VMEM_LIMIT = 64 << 20


def in_kernel(activation: AbstractActivation, h: Array) -> bool:
    """Whether `gated_vjp` takes `activation` on a first product shaped like `h`
    in its kernel: one of `KERNEL_ACTIVATIONS` (the exact GELU only in its tanh
    approximation: Mosaic has no `erfc`), rows, and halves of whole 128-lane
    columns."""
    if type(activation) not in KERNEL_ACTIVATIONS:
        return False
    if isinstance(activation, GeGLU) and not activation.approximate:
        return False
    return (
        h.ndim == 2
        and h.shape[0] > 0
        and h.shape[1] % 256 == 0
        and jnp.issubdtype(h.dtype, jnp.floating)
    )


def _rows_per_step(d_ff: int, itemsize: int = 2) -> int:
    # Per row: h, its cotangent and the hidden units' cotangent double-buffered
    # (`itemsize` bytes a value), and about eight float32 rows of `d_ff` of
    # temporaries.
    per_row = 2 * itemsize * (2 * d_ff) * 2 + 2 * itemsize * d_ff + 8 * 4 * d_ff
    return max(16, min(512, _TILE_BYTES // per_row // 16 * 16))


def gated_vjp(
    activation: AbstractActivation,
    h: Float[Array, "rows two_d_ff"],
    ct: Float[Array, "rows d_ff"],
    *,
    interpret: bool = False,
) -> Float[Array, "rows two_d_ff"]:
    """The cotangent of `h` (in `h.dtype`) for the cotangent `ct` of
    `activation(h)`: the kernel where `in_kernel(activation, h)`, else JAX's own
    vjp of the two halves."""
    if not in_kernel(activation, h):
        return halves_cotangent(activation, h, ct)
    return _gated_vjp(activation, interpret, h, ct)


@ft.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _gated_vjp(activation, interpret, h, ct):
    rows, width = h.shape
    d_ff = width // 2
    tm = min(_rows_per_step(d_ff, h.dtype.itemsize), -(-rows // 16) * 16)

    def kernel(h_ref, ct_ref, out):
        d_gate, d_up = halves_vjp(activation, h_ref[...], ct_ref[...])
        out[:, :d_ff] = d_gate.astype(out.dtype)
        out[:, d_ff:] = d_up.astype(out.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
        grid=(-(-rows // tm),),
        in_specs=[
            pl.BlockSpec((tm, width), lambda i: (i, 0)),
            pl.BlockSpec((tm, d_ff), lambda i: (i, 0)),
        ],
        out_specs=pl.BlockSpec((tm, width), lambda i: (i, 0)),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=_VMEM_LIMIT
        ),
        interpret=interpret,
        name="moe_eqx_gated_vjp",
    )(h, ct)


@_gated_vjp.defjvp
def _gated_vjp_jvp(activation, interpret, primals, tangents):
    # The kernel's value; its tangent JAX's own of the same formula.
    out = _gated_vjp(activation, interpret, *primals)
    _, t_out = jax.jvp(ft.partial(halves_cotangent, activation), primals, tangents)
    return out, t_out
