"""A tiled grouped matmul in pure JAX: the CPU backend (and the GPU fallback).

Each group's rows are cut into windows that never straddle a group boundary (a
group's last window is clamped into the array and masked), so every window is one
dense `[W, K] @ [K, N]` product with its group's matrix, and the work follows the
traced `group_sizes`: one compiled program serves every routing.

Two window sizes: XLA compiles each loop body and each fused kernel separately, so a
ladder of window sizes (one loop each) multiplies the compile time, while with one size
a group's last window is mostly padding unless the groups are whole windows. The sizes
are chosen at trace time from the static shapes (`window_rows`): `big` windows cut a
typical group into the fewest of at most 1024 rows (larger windows run closer to the
speed of one large matmul), and a group's rows left over after its `big` windows run in
up to three `small` ones of a quarter the size (or one more `big` one). A loop over the
groups holds each group's weights (and, backward, its summed weight gradient) while two
inner loops run its windows. The expert FFN (`TiledGMM.ffn`) runs both products and the
activation in those loops.

Derivatives: the loops are the raw products of `moe_eqx._gmm._products` (`gmm`,
`gmm_t`, `tgmm`, and a backward pass that computes the rows' gradient and sums each
group's weight gradient over its windows in float32, storing it once per group), which
makes them differentiable to every order: forward mode (`jax.jvp`, `jax.jacfwd`),
reverse mode and their compositions, reverse over reverse included; a gradient nobody
asked for (the weights', or the rows') is not computed. The FFN (`jax.custom_jvp`,
its tangent a `custom_linear`) runs its forward, tangent and backward in one loop each;
their trip counts are traced, so JAX could never transpose their derivatives: each is
evaluated as it is and differentiated (for higher orders) as the same function
composed of those products and plain-JAX activations (`moe_eqx._autodiff.fused`).
"""

import functools as ft
import math
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from .._activation import SWIGLU, AbstractActivation, apply_activation
from .._autodiff import custom_linear, fused, symbolic_zeros_to_none
from .._quant import QuantizedArray, QuantizedWeight, QuantizedWithBias, as_float
from .._rules import (
    HIDDEN,
    acc_dtype,
    cumsum,
    div,
    match_varying,
    remat_name,
    zeros_in_own_buffer,
)
from ._base import (
    AbstractGMMBackend,
    GradAcc,
    biased_two_products,
    two_products,
    with_tangent_of,
)
from ._products import AbstractProducts, gmm, gmm_t, tgmm
from .gathered import GatheredGMM

# Window rows: a typical group in the fewest windows of at most `_MAX_WINDOW` rows, and
# a quarter of that for the rest; below `_POW2_WINDOW` rows a power of two (XLA:CPU
# runs some small products, e.g. 40 or 48 rows by 1024 columns, much slower than their
# power-of-two neighbours), else a multiple of `_WINDOW_UNIT`.
_MIN_WINDOW = 16
_MAX_WINDOW = 1024
_POW2_WINDOW = 64
_WINDOW_UNIT = 8


class Windows(NamedTuple):
    """The two window sizes of the tiled loops (`small == big`: one size)."""

    big: int
    small: int


def _round_window(size: float) -> int:
    if size < _POW2_WINDOW:
        return max(_MIN_WINDOW, 1 << (max(int(size), 1).bit_length() - 1))
    return _WINDOW_UNIT * math.ceil(size / _WINDOW_UNIT)


def window_rows(
    num_rows: int, num_groups: int, tile_rows: int | tuple[int, int] | None = None
) -> Windows:
    """The window sizes for `num_rows` rows in `num_groups` groups.

    A group of `s` rows runs `s // big` windows of `big` rows, then its remaining
    rows in up to three windows of `small` rows, or in one more of `big` rows when
    they need more. `big` cuts a typical group, the mean plus two standard deviations
    of a uniformly routed one (`mean + 2 sqrt(mean)` rows), into the fewest windows of
    at most 1024 rows; `small` is a quarter of it, for the groups (and remainders) that
    routing leaves smaller, such as a receive buffer filled to half. Each is rounded up
    to a multiple of 8 rows (below 64 rows, down to a power of two, at least 16); with
    `small` under 16 rows there is one size. `tile_rows` gives one size, or the pair
    `(big, small)`. Never more than `num_rows` (and at least 1).

    **Arguments:**

    - `num_rows`: `M`, the rows of the grouped matmul (static).
    - `num_groups`: `G`, its groups (static).
    - `tile_rows`: one explicit window size, an explicit `(big, small)`, or `None`.

    **Returns:**

    The [`Windows`][moe_eqx._gmm.tiled.Windows] `(big, small)`.
    """
    if isinstance(tile_rows, tuple):
        big, small = (max(1, min(t, num_rows)) for t in tile_rows)
        return Windows(big, small)
    if tile_rows is not None:
        size = max(1, min(tile_rows, num_rows))
        return Windows(size, size)
    mean = num_rows / max(num_groups, 1)
    typical = mean + 2 * math.sqrt(mean)
    big = _round_window(typical / max(1, math.ceil(typical / _MAX_WINDOW)))
    big = max(1, min(big, num_rows))
    small = _round_window(big / 4) if big / 4 >= _MIN_WINDOW else big
    return Windows(big, min(small, big))


# The index helpers below (`_index`, `_set_index`, `_take`, `_put`) only ever see
# non-negative indices: no wrap-around select is needed.
def _index(a, i):
    return lax.dynamic_index_in_dim(a, i, keepdims=False, allow_negative_indices=False)


def weight_block(w, g, dtype):
    """Group `g`'s weight `w[g]` in `dtype`; a `QuantizedArray`'s block is
    dequantized here, so only one group's float copy exists at a time."""
    if isinstance(w, QuantizedArray):
        return as_float(w.map_experts(lambda a: _index(a, g)), dtype)
    return _index(w, g).astype(dtype)


def _for_windows(
    group_sizes,
    windows: Windows,
    num_rows: int,
    body,
    carry,
    enter=None,
    leave=None,
    peel: bool = False,
):
    """Folds `body(carry, ctx, start, keep, first)` over every window of every group: a
    loop over the groups around two loops over the group's windows (see
    `window_rows`), `big` rows each, then `small` rows each. `start` is where the
    window's rows are read (clamped into the array), `keep [W, 1]` marks the rows it
    owns (its `W` is the window's size). Per group, `enter(carry, g) -> (carry, ctx)`
    runs before its windows (slicing its weights once, not once per window) and
    `leave(carry, g, ctx)` after them (storing a weight gradient summed in a `ctx`
    scratch once per group). `first` says the window is its group's first (a sum over
    the windows then starts with its product instead of adding it to zeros): with
    `peel`, the first `big` window runs in a loop of its own with the static
    `first=True`, and the first `small` one has a traced `first` (true when the group
    has no `big` window); `first` is `False` otherwise."""
    big, small = windows
    sizes = group_sizes.astype(jnp.int32)
    ends = cumsum(sizes)
    most_small = max(1, 3 * (big // small) // 4)

    def group(g, carry):
        size = _index(sizes, g)
        begin = _index(ends, g) - size
        carry, ctx = (carry, g) if enter is None else enter(carry, g)
        if small == big:
            big_trips, small_trips = div(size + big - 1, big), None
        else:
            full = div(size, big)
            rest = size - full * big
            small_trips = div(rest + small - 1, small)
            use_small = small_trips <= most_small
            big_trips = full + jnp.where(use_small, 0, jnp.minimum(rest, 1))
            small_trips = jnp.where(use_small, small_trips, 0)

        def one(i, state, first=False, window=big, offset=0):
            carry, ctx = state
            first_row = begin + offset + i * window
            start = jnp.minimum(first_row, num_rows - window)
            rows = start + jnp.arange(window, dtype=jnp.int32)
            keep = ((rows >= first_row) & (rows < begin + size))[:, None]
            if not isinstance(first, bool):
                first = first & (i == 0)
            return body(carry, ctx, start, keep, first)

        state = (carry, ctx)
        if peel:
            # 0 or 1 trips: a `lax.cond` would copy the carry.
            trips = jnp.minimum(big_trips, 1)
            state = lax.fori_loop(0, trips, ft.partial(one, first=True), state)
        state = lax.fori_loop(1 if peel else 0, big_trips, one, state)
        if small_trips is not None:
            first = big_trips == 0 if peel else False
            tail = ft.partial(one, first=first, window=small, offset=big_trips * big)
            state = lax.fori_loop(0, small_trips, tail, state)
        carry, ctx = state
        return carry if leave is None else leave(carry, g, ctx)

    return lax.fori_loop(0, sizes.shape[0], group, carry)


def _set_index(a, value, i):
    return lax.dynamic_update_index_in_dim(a, value, i, 0, allow_negative_indices=False)


def _take(a, start, window: int):
    return lax.dynamic_slice_in_dim(a, start, window, allow_negative_indices=False)


def _put(a, rows, start, keep):
    """Writes the window's owned rows into `a`, keeping the others."""
    rows = jnp.where(keep, rows.astype(a.dtype), _take(a, start, rows.shape[0]))
    return lax.dynamic_update_slice_in_dim(
        a, rows, start, 0, allow_negative_indices=False
    )


def _enter_blocks(carry, g, fresh: bool):
    """A group's weight-gradient blocks to sum into: the scratch `carry[2]` when
    `fresh` (the group's first window overwrites it, see `_add`), else the group's
    blocks of the accumulators `carry[1]`."""
    return carry[2] if fresh else tuple(_index(o, g) for o in carry[1])


def _leave_blocks(carry, g, size, blocks, fresh: bool):
    """Stores a group's summed weight-gradient `blocks` into the `[G, ...]`
    accumulators `carry[1]`; with `fresh` keeps them as the scratch `carry[2]`, and
    an empty group's blocks, stale (the previous group's), are stored as zeros."""
    rows, outs, scratch = carry
    if fresh:
        scratch = tuple(blocks)
        blocks = [jnp.where(size > 0, b, 0) for b in blocks]
    outs = tuple(_set_index(o, b, g) for o, b in zip(outs, blocks, strict=True))
    return rows, outs, scratch


def _add(total, product, first):
    """`product` for a group's first window (`total` is stale), else `total + product`
    (`first`: a bool, or traced)."""
    if isinstance(first, bool):
        return product if first else total + product
    return jnp.where(first, product, total + product)


def _dot(a, b, dtype):
    """`a @ b` accumulated in `acc_dtype`, returned in `dtype`."""
    return jnp.matmul(a, b, preferred_element_type=acc_dtype(a.dtype)).astype(dtype)


# ---------------------------------------------------------------------------------
# The raw grouped products (see `moe_eqx._gmm._products`).


def _gmm_forward(lhs, rhs, group_sizes, windows, transpose_rhs=False):
    """`lhs_i @ rhs[g]` (`rhs[g]^T` with `transpose_rhs`) in `lhs.dtype`."""
    num_rows = lhs.shape[0]
    columns = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    # The windows' loop writes its rows in place.
    out = zeros_in_own_buffer((num_rows, columns), lhs.dtype, group_sizes, lhs, rhs)
    if num_rows == 0:
        return out

    def enter(out, g):
        w = weight_block(rhs, g, lhs.dtype)
        return out, w.T if transpose_rhs else w

    def body(out, w, start, keep, first):
        window = keep.shape[0]
        y = _dot(_take(lhs, start, window), w, lhs.dtype)
        return _put(out, y, start, keep), w

    return _for_windows(group_sizes, windows, num_rows, body, out, enter)


def _gmm_backward(lhs, rhs, group_sizes, d_out, windows, want_lhs, want_rhs):
    """`(d_lhs, d_rhs)` (each `None` unless wanted): `d_lhs = gmm(d_out, rhs^T)` in
    `lhs.dtype`, `d_rhs[g] = lhs_g^T d_out_g` summed in float32 (`[G, K, N]` float32;
    `rhs` may be `None` when `d_lhs` is not wanted), in one pass over the windows."""
    num_rows, num_groups = lhs.shape[0], group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    d_out = d_out.astype(lhs.dtype)
    acc = acc_dtype(lhs.dtype)
    like = (lhs, d_out) if rhs is None else (lhs, d_out, rhs)
    # The backward loop's outputs and scratch, each written in place.
    d_lhs = (
        zeros_in_own_buffer(lhs.shape, lhs.dtype, sizes, *like) if want_lhs else None
    )
    shape = (num_groups, lhs.shape[1], d_out.shape[1])
    d_rhs = zeros_in_own_buffer(shape, acc, sizes, *like) if want_rhs else None
    # A group's `d_rhs` block is summed in a `[K, N]` scratch carried from group to
    # group (its first window writes it) and stored once per group.
    outs = (d_rhs,) if want_rhs else ()
    scratch = (zeros_in_own_buffer(shape[1:], acc, sizes, *like),) if want_rhs else ()
    # Rows a window does not own are masked out of `d_rhs` on the narrower of its
    # two operands (`d_lhs` keeps only the owned rows anyway).
    mask_lhs = lhs.shape[1] <= d_out.shape[1]

    def enter(carry, g):
        w = weight_block(rhs, g, lhs.dtype) if want_lhs else None
        return carry, (w, _enter_blocks(carry, g, fresh=True))

    def body(carry, ctx, start, keep, first):
        window = keep.shape[0]
        d_lhs = carry[0]
        w, blocks = ctx
        dy = _take(d_out, start, window)
        if want_lhs:
            d_lhs = _put(d_lhs, _dot(dy, w.T, lhs.dtype), start, keep)
        if want_rhs:
            x = _take(lhs, start, window)
            if mask_lhs:
                x = jnp.where(keep, x, 0)
            else:
                dy = jnp.where(keep, dy, 0)
            blocks = (_add(blocks[0], _dot(x.T, dy, acc), first),)
        return (d_lhs, *carry[1:]), (w, blocks)

    def leave(carry, g, ctx):
        return _leave_blocks(carry, g, _index(sizes, g), ctx[1], fresh=True)

    if num_rows > 0:
        carry = (d_lhs, outs, scratch)
        d_lhs, outs, _ = _for_windows(
            sizes, windows, num_rows, body, carry, enter, leave, peel=want_rhs
        )
    return d_lhs, outs[0] if want_rhs else None


class _TiledProducts(AbstractProducts):
    """The loops over windows of `windows` rows."""

    windows: Windows = eqx.field(static=True)
    has_effects: ClassVar[bool] = False

    def gmm(self, a, b, group_sizes):
        return _gmm_forward(a, b, group_sizes, self.windows)

    def gmm_t(self, a, b, group_sizes):
        return _gmm_forward(a, b, group_sizes, self.windows, transpose_rhs=True)

    def tgmm(self, a, d, group_sizes):
        return _gmm_backward(a, None, group_sizes, d, self.windows, False, True)[1]

    def backward(self, a, b, group_sizes, d_out, want):
        return _gmm_backward(a, b, group_sizes, d_out, self.windows, *want)


# ---------------------------------------------------------------------------------
# The expert FFN, `act(x @ w_gate_up) @ w_down`, in one loop.


def _ffn_forward(x, w_gate_up, w_down, group_sizes, windows, act, keep_gate_up: bool):
    """`(out, gate_up)`: the FFN's output and (with `keep_gate_up`) its first product,
    the backward's residual."""
    num_rows = x.shape[0]
    like = (x, w_gate_up, w_down)
    # The windows' loop writes the output (and the kept first product) in place.
    out = zeros_in_own_buffer((num_rows, w_down.shape[2]), x.dtype, group_sizes, *like)
    gate_up = None
    if keep_gate_up:
        shape = (num_rows, w_gate_up.shape[2])
        gate_up = zeros_in_own_buffer(shape, x.dtype, group_sizes, *like)
    if num_rows == 0:
        return out, gate_up

    def enter(carry, g):
        return carry, (
            weight_block(w_gate_up, g, x.dtype),
            weight_block(w_down, g, x.dtype),
        )

    def body(carry, ctx, start, keep, first):
        window = keep.shape[0]
        (out, gate_up), (w_gu, w_dn) = carry, ctx
        gu = _dot(_take(x, start, window), w_gu, x.dtype)
        y = _dot(apply_activation(act, gu).astype(x.dtype), w_dn, x.dtype)
        if gate_up is not None:
            gate_up = _put(gate_up, gu, start, keep)
        return (_put(out, y, start, keep), gate_up), ctx

    return _for_windows(group_sizes, windows, num_rows, body, (out, gate_up), enter)


def _ffn_unfused(x, w_gate_up, w_down, group_sizes, windows, act):
    products = _TiledProducts(windows)
    gate_up = gmm(products, x, w_gate_up, group_sizes)
    out = gmm(
        products, apply_activation(act, gate_up).astype(x.dtype), w_down, group_sizes
    )
    return out, gate_up


def _ffn_with_gate_up(x, w_gate_up, w_down, group_sizes, windows, act):
    """`(out, gate_up)` in one loop, differentiated as two gmms."""
    fast = ft.partial(_ffn_forward, keep_gate_up=True)
    return fused(fast, _ffn_unfused, x, w_gate_up, w_down, group_sizes, windows, act)


class _FFNRes(NamedTuple):
    x: Array
    w_gate_up: Array
    w_down: Array
    gate_up: Array
    group_sizes: Array
    windows: Windows
    act: AbstractActivation
    acc: tuple | None = None  # the accumulators' `ShapeDtypeStruct`s, if any


def _ffn_tangent_fused(res: _FFNRes, t_x, t_gu, t_dn):
    x = res.x
    num_rows = x.shape[0]
    shape = (num_rows, res.w_down.shape[2])
    # The tangent loop writes its rows in place.
    out = zeros_in_own_buffer(shape, x.dtype, res.group_sizes, x, res.w_gate_up)

    def enter(out, g):
        ws = (res.w_gate_up if t_x is not None else None, t_gu, res.w_down, t_dn)
        return out, tuple(
            None if w is None else weight_block(w, g, x.dtype) for w in ws
        )

    def body(out, ws, start, keep, first):
        window = keep.shape[0]
        w_gu, t_w_gu, w_dn, t_w_dn = ws
        gu = _take(res.gate_up, start, window)
        t_gate_up = jnp.zeros(gu.shape, jnp.float32)
        if t_x is not None:
            t_gate_up += _dot(_take(t_x, start, window), w_gu, jnp.float32)
        if t_gu is not None:
            t_gate_up += _dot(_take(x, start, window), t_w_gu, jnp.float32)
        act, t_act = res.act.jvp(gu, t_gate_up.astype(x.dtype))
        t_y = _dot(t_act.astype(x.dtype), w_dn, jnp.float32)
        if t_dn is not None:
            t_y += _dot(act.astype(x.dtype), t_w_dn, jnp.float32)
        return _put(out, t_y, start, keep), ws

    if num_rows > 0:
        out = _for_windows(res.group_sizes, res.windows, num_rows, body, out, enter)
    return out


def _ffn_tangent_unfused(res: _FFNRes, t_x, t_gu, t_dn):
    x, w_gate_up, w_down, gate_up, group_sizes, windows, act, _ = res
    products = _TiledProducts(windows)
    t_gate_up = jnp.zeros(gate_up.shape, jnp.float32)
    if t_x is not None:
        t_gate_up += gmm(products, t_x, w_gate_up, group_sizes).astype(jnp.float32)
    if t_gu is not None:
        t_gate_up += gmm(products, x, t_gu, group_sizes).astype(jnp.float32)
    a, t_act = act.jvp(gate_up, t_gate_up.astype(x.dtype))
    t_y = gmm(products, t_act.astype(x.dtype), w_down, group_sizes)
    if t_dn is not None:
        t_y += gmm(products, a.astype(x.dtype), t_dn, group_sizes)
    return t_y


def _with_acc(t_w, t_acc, w):
    """The tangent the weights `w` take: theirs plus their accumulator's."""
    if t_acc is None:
        return t_w
    t_acc = t_acc.astype(w.dtype)
    return t_acc if t_w is None else t_w + t_acc


def _ffn_tangent(res: _FFNRes, lin):
    """The FFN's tangent in `(x, w_gate_up, w_down[, grad_acc])` (`None`: zero): the
    accumulators count as the weights' (see `AbstractGMMBackend.ffn`) and pass
    through."""
    t_x, t_gu, t_dn, *t_acc = lin  # `t_acc`: `[(t_acc_gu, t_acc_dn) or None]`, `[]`
    if t_acc and t_acc[0] is not None:
        t_gu = _with_acc(t_gu, t_acc[0][0], res.w_gate_up)
        t_dn = _with_acc(t_dn, t_acc[0][1], res.w_down)
    args = (res, t_x, t_gu, t_dn)
    t_out = fused(_ffn_tangent_fused, _ffn_tangent_unfused, *args)
    if not t_acc:
        return t_out
    if t_acc[0] is None:
        return t_out, tuple(jnp.zeros(s.shape, s.dtype) for s in res.acc)
    return t_out, t_acc[0]


def _ffn_backward_fused(res: _FFNRes, d_out, acc_in, want_x: bool, want_w: bool):
    x = res.x
    num_rows = x.shape[0]
    sizes = res.group_sizes
    acc = acc_dtype(x.dtype)
    d_out = d_out.astype(x.dtype)
    like = (x, d_out, res.w_gate_up, res.w_down)
    # Without accumulators a group's weight-gradient blocks are summed in a scratch
    # carried from group to group (its first window writes them), with them in the
    # accumulators' blocks; stored once per group either way.
    fresh = acc_in is None
    want_w = want_w or not fresh
    # The backward loop's outputs and scratch, each written in place.
    d_x = zeros_in_own_buffer(x.shape, x.dtype, sizes, *like) if want_x else None
    outs = scratch = ()
    if not fresh:
        outs = tuple(match_varying(*(a.astype(acc) for a in acc_in), *like)[:2])
    elif want_w:
        weights = (res.w_gate_up, res.w_down)
        outs = tuple(zeros_in_own_buffer(w.shape, acc, sizes, *like) for w in weights)
        scratch = tuple(
            zeros_in_own_buffer(w.shape[1:], acc, sizes, *like) for w in weights
        )

    def enter(carry, g):
        w_gu = weight_block(res.w_gate_up, g, x.dtype) if want_x else None
        w_dn = weight_block(res.w_down, g, x.dtype)
        blocks = _enter_blocks(carry, g, fresh) if want_w else ()
        return carry, (w_gu, w_dn, blocks)

    def body(carry, ctx, start, keep, first):
        window = keep.shape[0]
        d_x = carry[0]
        w_gu, w_dn, blocks = ctx
        dy = jnp.where(keep, _take(d_out, start, window), 0)
        gu = _take(res.gate_up, start, window)
        d_act = _dot(dy, w_dn.T, x.dtype)
        d_gate_up = res.act.vjp(gu, d_act).astype(x.dtype)
        if want_x:
            d_x = _put(d_x, _dot(d_gate_up, w_gu.T, x.dtype), start, keep)
        if want_w:
            act = apply_activation(res.act, gu).astype(x.dtype)
            x_w = _take(x, start, window)
            blocks = (
                _add(blocks[0], _dot(x_w.T, d_gate_up, acc), first),
                _add(blocks[1], _dot(act.T, dy, acc), first),
            )
        return (d_x, *carry[1:]), (w_gu, w_dn, blocks)

    def leave(carry, g, ctx):
        return _leave_blocks(carry, g, _index(sizes, g), ctx[2], fresh)

    if num_rows > 0:
        carry = (d_x, outs, scratch)
        d_x, outs, _ = _for_windows(
            sizes,
            res.windows,
            num_rows,
            body,
            carry,
            enter,
            leave,
            peel=want_w and fresh,
        )
    d_gu, d_dn = outs if want_w else (None, None)
    return d_x, d_gu, d_dn


def _ffn_backward_unfused(res: _FFNRes, d_out, acc_in, want_x: bool, want_w: bool):
    x, w_gate_up, w_down, gate_up, group_sizes, windows, act, _ = res
    products = _TiledProducts(windows)
    acc = acc_dtype(x.dtype)
    d_out = d_out.astype(x.dtype)
    d_act = gmm_t(products, d_out, w_down, group_sizes)
    d_gate_up = act.vjp(gate_up, d_act).astype(x.dtype)
    d_x = d_gu = d_dn = None
    if want_x:
        d_x = gmm_t(products, d_gate_up, w_gate_up, group_sizes)
    if want_w or acc_in is not None:
        a = apply_activation(act, gate_up).astype(x.dtype)
        d_gu = tgmm(products, x, d_gate_up, group_sizes).astype(acc)
        d_dn = tgmm(products, a, d_out, group_sizes).astype(acc)
        if acc_in is not None:
            d_gu, d_dn = d_gu + acc_in[0].astype(acc), d_dn + acc_in[1].astype(acc)
    return d_x, d_gu, d_dn


def _ffn_backward(res: _FFNRes, d_out, acc_in, want_x: bool, want_w: bool):
    """`(d_x, d_w_gate_up, d_w_down)` in one pass over the windows, each `None` unless
    wanted (the weights' summed in float32); with accumulators `acc_in` the weight
    gradients are added into them in place instead (returned in their place)."""
    args = (res, d_out, acc_in, want_x, want_w)
    return fused(_ffn_backward_fused, _ffn_backward_unfused, *args)


def _ffn_transpose(res: _FFNRes, ct, want):
    """The transpose of `_ffn_tangent`; `want`: which of `(x, w_gate_up, w_down,
    grad_acc)` get a cotangent (the last only with accumulators)."""
    want_x, want_gu, want_dn, *want_acc = want
    d_out, ct_acc = ct if want_acc else (ct, None)
    weights = (res.w_gate_up, res.w_down)
    if want_acc and want_acc[0] and not (want_gu or want_dn):
        # The weights' gradient summed into the accumulators' cotangent in place.
        d_x, *acc = _ffn_backward(res, d_out, ct_acc, want_x, True)
        acc = tuple(a.astype(c.dtype) for a, c in zip(acc, ct_acc, strict=True))
        return d_x, None, None, acc
    d_x, *d_w = _ffn_backward(res, d_out, None, want_x, want_gu or want_dn)
    out = [d_x]
    for wanted, d, w in zip((want_gu, want_dn), d_w, weights, strict=True):
        out.append(d.astype(w.dtype) if wanted else None)
    if want_acc:
        acc = None
        if want_acc[0]:
            acc = tuple(c + d.astype(c.dtype) for c, d in zip(ct_acc, d_w, strict=True))
        out.append(acc)
    return tuple(out)


@ft.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _tiled_ffn(x, w_gate_up, w_down, group_sizes, windows, act, grad_acc):
    out = _ffn_forward(x, w_gate_up, w_down, group_sizes, windows, act, False)[0]
    return out if grad_acc is None else (out, grad_acc)


def _tiled_ffn_jvp(windows, act, primals, tangents):
    x, w_gate_up, w_down, group_sizes, grad_acc = primals
    t_x, t_gu, t_dn, _, t_acc = symbolic_zeros_to_none(tangents)
    if grad_acc is not None:
        # The same weights, whose derivative (a higher order's) is also the
        # accumulators'.
        w_gate_up = with_tangent_of(w_gate_up, grad_acc[0])
        w_down = with_tangent_of(w_down, grad_acc[1])
    out, gate_up = _ffn_with_gate_up(x, w_gate_up, w_down, group_sizes, windows, act)
    gate_up = remat_name(gate_up, HIDDEN)
    res = _FFNRes(x, w_gate_up, w_down, gate_up, group_sizes, windows, act)
    want = (t_x is not None, t_gu is not None, t_dn is not None)
    lin = (t_x, t_gu, t_dn)
    if grad_acc is None:
        transpose = ft.partial(_ffn_transpose, want=want)
        return out, custom_linear(_ffn_tangent, transpose, res, lin, out)

    # The accumulators' tangent counts as the weights' (see `_ffn_tangent`).
    want_acc = any(t is not None for t in t_acc)
    if want_acc:
        t_acc = tuple(
            jnp.zeros_like(a) if t is None else t
            for a, t in zip(grad_acc, t_acc, strict=True)
        )
    acc = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in grad_acc)
    res = res._replace(acc=acc)
    transpose = ft.partial(_ffn_transpose, want=(*want, want_acc))
    out_t = tuple(p if w else None for p, w in zip(primals[:3], want, strict=True))
    out_t = (*out_t, grad_acc if want_acc else None)
    primal = (out, grad_acc)
    lin = (*lin, t_acc if want_acc else None)
    return primal, custom_linear(_ffn_tangent, transpose, res, lin, primal, out_t)


_tiled_ffn.defjvp(_tiled_ffn_jvp, symbolic_zeros=True)


def tiled_ffn(
    x: Float[Array, "rows d_in"],
    w_gate_up: Float[Array, "groups d_in two_d_ff"] | QuantizedWeight,
    w_down: Float[Array, "groups d_ff d_model"] | QuantizedWeight,
    group_sizes: Int[Array, " groups"],
    *,
    tile_rows: int | tuple[int, int] | None = None,
    grad_acc: GradAcc | None = None,
    activation: AbstractActivation = SWIGLU,
):
    """The expert FFN over groups of rows in one loop of windows; see
    `moe_eqx.AbstractGMMBackend.ffn` for the arguments and results."""
    windows = window_rows(x.shape[0], w_gate_up.shape[0], tile_rows)
    x, w_gate_up, w_down, group_sizes = match_varying(
        x, w_gate_up, w_down, group_sizes.astype(jnp.int32)
    )
    return _tiled_ffn(x, w_gate_up, w_down, group_sizes, windows, activation, grad_acc)


class TiledGMM(AbstractGMMBackend):
    """Grouped matmul as a loop of dense row windows that never straddle a group.

    Pure JAX (`lax.fori_loop`s whose trip counts come from the traced `group_sizes`),
    with its own derivatives (see the module): a backward loop over the same windows
    computes `d_lhs` and `d_rhs[g] = lhs_g^T @ d_out_g`, each group's block summed in
    float32. Its `ffn` runs the whole expert FFN in one loop of windows. With fewer
    rows than groups (a static choice) both gather each row's matrix instead
    (`GatheredGMM`): the loop would read every group's weights.

    **Arguments:**

    - `tile_rows`: rows per window (one size), or `(big, small)`: windows of `big`
        rows, then up to three of `small` rows for the rows left over; `None` picks
        the pair from the shapes (see `window_rows`). The loops hold a few buffers of
        `W` rows by `2 d_ff` columns: smaller windows hold less, and run slower.
    """

    tile_rows: int | tuple[int, int] | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        sizes = self.tile_rows
        if sizes is None:
            return
        pair = isinstance(sizes, tuple)
        if (
            (pair and len(sizes) != 2)
            or any(
                not isinstance(s, int) or s < 1 for s in (sizes if pair else [sizes])
            )
            or (pair and sizes[1] > sizes[0])
        ):
            raise ValueError(
                "`tile_rows` must be a positive int or a pair `(big, small)` of "
                f"positive ints with `small <= big`, got {sizes!r}."
            )

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        if lhs.shape[0] < rhs.shape[0]:
            return GatheredGMM()(lhs, rhs, group_sizes)
        with jax.named_scope("moe_eqx.gmm.tiled"):
            windows = window_rows(lhs.shape[0], rhs.shape[0], self.tile_rows)
            lhs, rhs, group_sizes = match_varying(
                lhs, rhs, group_sizes.astype(jnp.int32)
            )
            return gmm(_TiledProducts(windows), lhs, rhs, group_sizes)

    def ffn(
        self,
        x: Float[Array, "rows d_in"],
        w_gate_up: Float[Array, "groups d_in two_d_ff"] | QuantizedWeight,
        w_down: Float[Array, "groups d_ff d_model"] | QuantizedWeight,
        group_sizes: Int[Array, " groups"],
        grad_acc: GradAcc | None = None,
        *,
        activation: AbstractActivation = SWIGLU,
    ):
        if x.shape[0] < w_gate_up.shape[0]:
            return GatheredGMM().ffn(
                x, w_gate_up, w_down, group_sizes, grad_acc, activation=activation
            )
        windows = window_rows(x.shape[0], w_gate_up.shape[0], self.tile_rows)
        products = _TiledProducts(windows)

        def product(lhs, w, sizes):
            lhs, w, sizes = match_varying(lhs, w, sizes)
            return gmm(products, lhs, w, sizes)

        sizes = group_sizes.astype(jnp.int32)
        if isinstance(w_gate_up, QuantizedWithBias) and grad_acc is None:
            # Two products on the quantized weights with the biases added between
            # them (the fused loop's derivatives take float weights whole).
            with jax.named_scope("moe_eqx.gmm.tiled"):
                return biased_two_products(
                    product, x, w_gate_up, w_down, sizes, activation
                )
        if activation.collective:
            # Applied once to the whole first product: in the loop of windows,
            # whose count differs between devices, its collectives would not match.
            with jax.named_scope("moe_eqx.gmm.tiled"):
                weights = [
                    as_float(w, w.dtype) if isinstance(w, QuantizedWithBias) else w
                    for w in (w_gate_up, w_down)
                ]
                if grad_acc is not None:  # see `AbstractGMMBackend.ffn`
                    weights = [
                        with_tangent_of(w, a)
                        for w, a in zip(weights, grad_acc, strict=True)
                    ]
                out = two_products(product, x, *weights, sizes, activation)
                return out if grad_acc is None else (out, grad_acc)
        w_gate_up, w_down = (
            as_float(w, w.dtype) if isinstance(w, QuantizedWithBias) else w
            for w in (w_gate_up, w_down)
        )
        with jax.named_scope("moe_eqx.gmm.tiled"):
            return tiled_ffn(
                x,
                w_gate_up,
                w_down,
                group_sizes,
                tile_rows=self.tile_rows,
                grad_acc=grad_acc,
                activation=activation,
            )
