"""A tiled grouped matmul in pure JAX: the CPU backend (and the GPU fallback).

Each group's rows are cut into windows of `W` rows that never straddle a group
boundary (a group's last window is clamped into the array and masked), so every
window is one dense `[W, K] @ [K, N]` product with its group's matrix, and the work
follows the traced `group_sizes`: one compiled program serves every routing.

One window size: XLA compiles each loop body and each fused kernel separately, so a
ladder of window sizes (one loop each) multiplies the compile time. The size is chosen
at trace time from the static shapes (`window_rows`) so that a typical group is a whole
number of windows: a group's last window is mostly padding otherwise, and larger
windows run closer to the speed of one large matmul. A loop over the groups holds each
group's weights (and, backward, its summed weight gradient) while an inner loop runs
its windows. The expert FFN (`TiledGMM.ffn`) runs both products and the activation in
those loops.

Derivatives: `jax.custom_jvp`, whose tangent is a `custom_linear`
(`moe_eqx._autodiff`) transposing to one backward pass over the same windows: it
computes the rows' gradient and sums each group's weight gradient over its windows in
float32, storing it once per group. So forward mode (`jax.jvp`, `jax.jacfwd`),
reverse mode and their compositions all work, and a gradient nobody asked for (the
weights', or the rows') is not computed.
"""

import functools as ft
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from .._autodiff import custom_linear, symbolic_zeros_to_none
from .._rules import acc_dtype, cumsum, div, match_varying
from ._base import SWIGLU, AbstractGMMBackend, Activation, GradAcc

# Window rows: at most `_MAX_WINDOW`; an even count of windows per typical group where
# they stay at least `_EVEN_WINDOW` rows; below `_POW2_WINDOW` rows a power of two
# (XLA:CPU runs some small products, e.g. 40 or 48 rows by 1024 columns, much slower
# than their power-of-two neighbours), else a multiple of `_WINDOW_UNIT`.
_MIN_WINDOW = 16
_MAX_WINDOW = 512
_EVEN_WINDOW = 128
_POW2_WINDOW = 64
_WINDOW_UNIT = 8


def window_rows(num_rows: int, num_groups: int, tile_rows: int | None = None) -> int:
    """The window size `W` for `num_rows` rows in `num_groups` groups.

    `tile_rows` if given. Else a typical group, the mean plus two standard deviations
    of a uniformly routed one (`mean + 2 sqrt(mean)` rows), is cut into the fewest
    windows of at most 512 rows, and their count is made even where the windows stay
    at least 128 rows: a receive buffer that routing fills to half (the exchange's
    buffers at `buffer_factor=2`) then still holds whole windows. Rounded up to a
    multiple of 8 rows (below 64 rows, down to a power of two, at least 16). Never
    more than `num_rows` (and at least 1).

    **Arguments:**

    - `num_rows`: `M`, the rows of the grouped matmul (static).
    - `num_groups`: `G`, its groups (static).
    - `tile_rows`: an explicit window size, or `None`.

    **Returns:**

    The window size in rows.
    """
    if tile_rows is None:
        mean = num_rows / max(num_groups, 1)
        typical = mean + 2 * math.sqrt(mean)
        count = max(1, math.ceil(typical / _MAX_WINDOW))
        if count % 2 and typical / (count + 1) >= _EVEN_WINDOW:
            count += 1
        size = typical / count
        if size < _POW2_WINDOW:
            tile_rows = max(_MIN_WINDOW, 1 << (max(int(size), 1).bit_length() - 1))
        else:
            tile_rows = _WINDOW_UNIT * math.ceil(size / _WINDOW_UNIT)
    return max(1, min(tile_rows, num_rows))


# The index helpers below (`_index`, `_set_index`, `_take`, `_put`) only ever see
# non-negative indices: no wrap-around select is needed.
def _index(a, i):
    return lax.dynamic_index_in_dim(a, i, keepdims=False, allow_negative_indices=False)


def _for_windows(
    group_sizes, window: int, num_rows: int, body, carry, enter=None, leave=None
):
    """Folds `body(carry, ctx, start, keep)` over every window of every group: a loop
    over the groups around a loop over the group's windows. `start` is where the
    window's `W` rows are read (clamped into the array), `keep [W, 1]` marks the rows
    it owns. Per group, `enter(carry, g) -> (carry, ctx)` runs before its windows
    (slicing its weights once, not once per window) and `leave(carry, g, ctx)` after
    them (storing a weight gradient summed in a `ctx` scratch once per group)."""
    sizes = group_sizes.astype(jnp.int32)
    ends = cumsum(sizes)

    def group(g, carry):
        size = _index(sizes, g)
        begin = _index(ends, g) - size
        carry, ctx = (carry, g) if enter is None else enter(carry, g)

        def one(i, state):
            carry, ctx = state
            first = begin + i * window
            start = jnp.minimum(first, num_rows - window)
            rows = start + jnp.arange(window, dtype=jnp.int32)
            keep = ((rows >= first) & (rows < begin + size))[:, None]
            return body(carry, ctx, start, keep)

        count = div(size + window - 1, window)
        carry, ctx = lax.fori_loop(0, count, one, (carry, ctx))
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


def _leave(carry, g, ctx):
    """Stores the group's summed weight gradient `ctx[1]` (if any) as `carry[1][g]`."""
    if ctx[1] is None:
        return carry
    return carry[0], _set_index(carry[1], ctx[1], g)


def _dot(a, b, dtype):
    """`a @ b` accumulated in `acc_dtype`, returned in `dtype`."""
    return jnp.matmul(a, b, preferred_element_type=acc_dtype(a.dtype)).astype(dtype)


def _zeros(shape, dtype, *like):
    return match_varying(jnp.zeros(shape, dtype), *like)[0]


# ---------------------------------------------------------------------------------
# One grouped matmul.


def _gmm_forward(lhs, rhs, group_sizes, window):
    num_rows = lhs.shape[0]
    out = _zeros((num_rows, rhs.shape[2]), lhs.dtype, lhs, rhs)
    if num_rows == 0:
        return out

    def enter(out, g):
        return out, _index(rhs, g).astype(lhs.dtype)

    def body(out, w, start, keep):
        y = _dot(_take(lhs, start, window), w, lhs.dtype)
        return _put(out, y, start, keep), w

    return _for_windows(group_sizes, window, num_rows, body, out, enter)


class _GMMRes(NamedTuple):
    lhs: Array
    rhs: Array
    group_sizes: Array
    window: int


def _gmm_tangent(res: _GMMRes, lin):
    t_lhs, t_rhs = lin
    terms = []
    if t_lhs is not None:
        terms.append(_gmm_forward(t_lhs, res.rhs, res.group_sizes, res.window))
    if t_rhs is not None:
        terms.append(_gmm_forward(res.lhs, t_rhs, res.group_sizes, res.window))
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _gmm_backward(res: _GMMRes, d_out, want_lhs: bool, want_rhs: bool):
    """`(d_lhs, d_rhs)` (each `None` unless wanted): `d_lhs = gmm(d_out, rhs^T)`,
    `d_rhs[g] = lhs_g^T d_out_g` (summed in float32), in one pass over the windows."""
    lhs, rhs, window = res.lhs, res.rhs, res.window
    num_rows = lhs.shape[0]
    d_out = d_out.astype(lhs.dtype)
    acc = acc_dtype(lhs.dtype)
    like = (lhs, d_out, rhs)
    d_lhs = _zeros(lhs.shape, lhs.dtype, *like) if want_lhs else None
    d_rhs = _zeros(rhs.shape, acc, *like) if want_rhs else None

    def enter(carry, g):
        w = _index(rhs, g).astype(lhs.dtype) if want_lhs else None
        return carry, (w, None if d_rhs is None else _index(carry[1], g))

    def body(carry, ctx, start, keep):
        (d_lhs, d_rhs), (w, block) = carry, ctx
        dy = jnp.where(keep, _take(d_out, start, window), 0)
        if want_lhs:
            d_lhs = _put(d_lhs, _dot(dy, w.T, lhs.dtype), start, keep)
        if want_rhs:
            block = block + _dot(_take(lhs, start, window).T, dy, acc)
        return (d_lhs, d_rhs), (w, block)

    if num_rows > 0:
        d_lhs, d_rhs = _for_windows(
            res.group_sizes, window, num_rows, body, (d_lhs, d_rhs), enter, _leave
        )
    return d_lhs, None if d_rhs is None else d_rhs.astype(rhs.dtype)


@ft.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _tiled_gmm(lhs, rhs, group_sizes, window):
    return _gmm_forward(lhs, rhs, group_sizes, window)


def _tiled_gmm_jvp(window, primals, tangents):
    lhs, rhs, group_sizes = primals
    t_lhs, t_rhs, _ = symbolic_zeros_to_none(tangents)
    out = _tiled_gmm(lhs, rhs, group_sizes, window)
    res = _GMMRes(lhs, rhs, group_sizes, window)

    def transpose(res, d_out):
        return _gmm_backward(res, d_out, t_lhs is not None, t_rhs is not None)

    return out, custom_linear(_gmm_tangent, transpose, res, (t_lhs, t_rhs), out)


_tiled_gmm.defjvp(_tiled_gmm_jvp, symbolic_zeros=True)


# ---------------------------------------------------------------------------------
# The expert FFN, `act(x @ w_gate_up) @ w_down`, in one loop.


def _ffn_forward(x, w_gate_up, w_down, group_sizes, window, act, keep_gate_up: bool):
    """`(out, gate_up)`: the FFN's output and (with `keep_gate_up`) its first product,
    the backward's residual."""
    num_rows = x.shape[0]
    like = (x, w_gate_up, w_down)
    out = _zeros((num_rows, w_down.shape[2]), x.dtype, *like)
    gate_up = None
    if keep_gate_up:
        gate_up = _zeros((num_rows, w_gate_up.shape[2]), x.dtype, *like)
    if num_rows == 0:
        return out, gate_up

    def enter(carry, g):
        return carry, (
            _index(w_gate_up, g).astype(x.dtype),
            _index(w_down, g).astype(x.dtype),
        )

    def body(carry, ctx, start, keep):
        (out, gate_up), (w_gu, w_dn) = carry, ctx
        gu = _dot(_take(x, start, window), w_gu, x.dtype)
        y = _dot(act(gu).astype(x.dtype), w_dn, x.dtype)
        if gate_up is not None:
            gate_up = _put(gate_up, gu, start, keep)
        return (_put(out, y, start, keep), gate_up), ctx

    return _for_windows(group_sizes, window, num_rows, body, (out, gate_up), enter)


class _FFNRes(NamedTuple):
    x: Array
    w_gate_up: Array
    w_down: Array
    gate_up: Array
    group_sizes: Array
    window: int
    act: Activation


def _ffn_tangent(res: _FFNRes, lin):
    """The FFN's tangent in `(x, w_gate_up, w_down)` (`None`: zero); accumulators
    pass through."""
    t_x, t_gu, t_dn, *t_acc = lin  # `t_acc`: `[(t_acc_gu, t_acc_dn)]` or `[]`
    x, window = res.x, res.window
    num_rows = x.shape[0]
    out = _zeros((num_rows, res.w_down.shape[2]), x.dtype, x, res.w_gate_up)

    def enter(out, g):
        ws = (res.w_gate_up if t_x is not None else None, t_gu, res.w_down, t_dn)
        return out, tuple(
            None if w is None else _index(w, g).astype(x.dtype) for w in ws
        )

    def body(out, ws, start, keep):
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
        out = _for_windows(res.group_sizes, window, num_rows, body, out, enter)
    return (out, t_acc[0]) if t_acc else out


def _ffn_backward(res: _FFNRes, d_out, acc_in, want_x: bool, want_w: bool):
    """`(d_x, d_w_gate_up, d_w_down)` in one pass over the windows, each `None` unless
    wanted (the weights' summed in float32); with accumulators `acc_in` the weight
    gradients are added into them in place instead (returned in their place)."""
    x, window = res.x, res.window
    num_rows = x.shape[0]
    acc = acc_dtype(x.dtype)
    d_out = d_out.astype(x.dtype)
    like = (x, d_out, res.w_gate_up, res.w_down)
    want_w = want_w or acc_in is not None
    d_x = _zeros(x.shape, x.dtype, *like) if want_x else None
    d_gu = d_dn = None
    if acc_in is not None:
        d_gu, d_dn = match_varying(*(a.astype(acc) for a in acc_in), *like)[:2]
    elif want_w:
        d_gu = _zeros(res.w_gate_up.shape, acc, *like)
        d_dn = _zeros(res.w_down.shape, acc, *like)

    def enter(carry, g):
        _, d_gu, d_dn = carry
        w_gu = _index(res.w_gate_up, g).astype(x.dtype) if want_x else None
        w_dn = _index(res.w_down, g).astype(x.dtype)
        blocks = (_index(d_gu, g), _index(d_dn, g)) if want_w else None
        return carry, (w_gu, w_dn, blocks)

    def body(carry, ctx, start, keep):
        d_x, d_gu, d_dn = carry
        w_gu, w_dn, blocks = ctx
        dy = jnp.where(keep, _take(d_out, start, window), 0)
        gu = _take(res.gate_up, start, window)
        d_act = _dot(dy, w_dn.T, x.dtype)
        d_gate_up = res.act.vjp(gu, d_act).astype(x.dtype)
        if want_x:
            d_x = _put(d_x, _dot(d_gate_up, w_gu.T, x.dtype), start, keep)
        if want_w:
            act = res.act(gu).astype(x.dtype)
            x_w = _take(x, start, window)
            blocks = (
                blocks[0] + _dot(x_w.T, d_gate_up, acc),
                blocks[1] + _dot(act.T, dy, acc),
            )
        return (d_x, d_gu, d_dn), (w_gu, w_dn, blocks)

    def leave(carry, g, ctx):
        d_x, d_gu, d_dn = carry
        if want_w:
            d_gu = _set_index(d_gu, ctx[2][0], g)
            d_dn = _set_index(d_dn, ctx[2][1], g)
        return d_x, d_gu, d_dn

    if num_rows > 0:
        d_x, d_gu, d_dn = _for_windows(
            res.group_sizes, window, num_rows, body, (d_x, d_gu, d_dn), enter, leave
        )
    return d_x, d_gu, d_dn


@ft.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _tiled_ffn(x, w_gate_up, w_down, group_sizes, window, act, grad_acc):
    out = _ffn_forward(x, w_gate_up, w_down, group_sizes, window, act, False)[0]
    return out if grad_acc is None else (out, grad_acc)


def _tiled_ffn_jvp(window, act, primals, tangents):
    x, w_gate_up, w_down, group_sizes, grad_acc = primals
    t_x, t_gu, t_dn, _, t_acc = symbolic_zeros_to_none(tangents)
    out, gate_up = _ffn_forward(x, w_gate_up, w_down, group_sizes, window, act, True)
    res = _FFNRes(x, w_gate_up, w_down, gate_up, group_sizes, window, act)
    want_x = t_x is not None
    if grad_acc is None:
        want_w = (t_gu is not None, t_dn is not None)

        def transpose(res, d_out):
            d_x, d_gu, d_dn = _ffn_backward(res, d_out, None, want_x, any(want_w))
            d_gu = d_gu.astype(res.w_gate_up.dtype) if want_w[0] else None
            d_dn = d_dn.astype(res.w_down.dtype) if want_w[1] else None
            return d_x, d_gu, d_dn

        lin = (t_x, t_gu, t_dn)
        return out, custom_linear(_ffn_tangent, transpose, res, lin, out)

    # The weight gradients go to the accumulators (the weights get no cotangent).
    def acc_transpose(res, ct):
        d_out, acc_in = ct
        d_x, d_gu, d_dn = _ffn_backward(res, d_out, acc_in, want_x, True)
        return d_x, None, None, (d_gu, d_dn)

    t_acc = tuple(
        jnp.zeros_like(a) if t is None else t
        for a, t in zip(grad_acc, t_acc, strict=True)
    )
    lin = (t_x, t_gu, t_dn, t_acc)
    out_t = (x if want_x else None, None, None, grad_acc)
    t_out = custom_linear(_ffn_tangent, acc_transpose, res, lin, (out, grad_acc), out_t)
    return (out, grad_acc), t_out


_tiled_ffn.defjvp(_tiled_ffn_jvp, symbolic_zeros=True)


def tiled_ffn(
    x: Float[Array, "rows d_in"],
    w_gate_up: Float[Array, "groups d_in two_d_ff"],
    w_down: Float[Array, "groups d_ff d_model"],
    group_sizes: Int[Array, " groups"],
    *,
    tile_rows: int | None = None,
    grad_acc: GradAcc | None = None,
    activation: Activation = SWIGLU,
):
    """The expert FFN over groups of rows in one loop of windows; see
    `moe_eqx.AbstractGMMBackend.ffn` for the arguments and results."""
    window = window_rows(x.shape[0], w_gate_up.shape[0], tile_rows)
    x, w_gate_up, w_down, group_sizes = match_varying(
        x, w_gate_up, w_down, group_sizes.astype(jnp.int32)
    )
    return _tiled_ffn(x, w_gate_up, w_down, group_sizes, window, activation, grad_acc)


class TiledGMM(AbstractGMMBackend):
    """Grouped matmul as a loop of dense row windows that never straddle a group.

    Pure JAX (`lax.fori_loop`s whose trip counts come from the traced `group_sizes`),
    with its own derivatives (see the module): a backward loop over the same windows
    computes `d_lhs` and `d_rhs[g] = lhs_g^T @ d_out_g`, each group's block summed in
    float32. Its `ffn` runs the whole expert FFN in one loop of windows.

    **Arguments:**

    - `tile_rows`: rows per window; `None` picks it from the shapes so that a
        typical group is a whole number of windows of at most 512 rows (see
        `window_rows`).
    """

    tile_rows: int | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.tile_rows is not None and self.tile_rows < 1:
            raise ValueError(f"`tile_rows` must be positive, got {self.tile_rows}.")

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        with jax.named_scope("moe_eqx.gmm.tiled"):
            window = window_rows(lhs.shape[0], rhs.shape[0], self.tile_rows)
            lhs, rhs, group_sizes = match_varying(
                lhs, rhs, group_sizes.astype(jnp.int32)
            )
            return _tiled_gmm(lhs, rhs, group_sizes, window)

    def ffn(
        self,
        x: Float[Array, "rows d_in"],
        w_gate_up: Float[Array, "groups d_in two_d_ff"],
        w_down: Float[Array, "groups d_ff d_model"],
        group_sizes: Int[Array, " groups"],
        grad_acc: GradAcc | None = None,
        *,
        activation: Activation = SWIGLU,
    ):
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
