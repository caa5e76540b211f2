"""A tiled grouped matmul in pure JAX: the fast CPU backend (and the GPU fallback).

Each group is cut into row windows that never straddle a group boundary, so every
window is one dense `[rows, K] @ [K, N]` product with its group's matrix. A group of
`s` rows takes `s // T` full windows of the largest size `T`, then one window for the
remainder `r`: the smallest entry `>= r` of a static ladder (`8, 16, 24, 32, 48, 64,
96, ...`: multiples of 8, two steps per doubling). So each group costs at most
`s // T + 1` products, and a window for more than 16 rows is under a third padding.
All trip counts come from the traced `group_sizes`: one compiled program serves every
routing.

Why few, large products: on a 2-core CPU (M=4096, K=512, N=1024, float32) a loop of
64-row products runs at ~70% of one big matmul and 16-row ones at ~35%. Each ladder
entry is one more loop to compile (~0.2 s on that CPU), which is why small problems
(`M < 2048`) use a coarser, power-of-two ladder.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from .._rules import acc_dtype, match_varying
from ._base import AbstractAccumulatingGMMBackend

# On a 2-core x86 CPU (benchmarks/gmm.py shapes) 512- and 256-row windows measured
# within noise of each other; 8-row granularity keeps remainder waste small.
DEFAULT_TILE_ROWS = 512
DEFAULT_MIN_TILE_ROWS = 8
# Below this many rows, compile time (~0.2 s per ladder size) matters more than the
# FLOPs a finer ladder saves: a judgement call, not a measured crossover.
_FINE_LADDER_ROWS = 2048


def window_ladder(
    tile_rows: int, min_tile_rows: int, num_rows: int, steps: int = 2
) -> tuple[int, ...]:
    """The static window sizes: multiples of `min_tile_rows` with `steps` steps per
    doubling (`8, 16, 24, 32, 48, 64, 96, ...` for 8 and 2 steps) up to `tile_rows`,
    capped at `num_rows`.

    **Arguments:**

    - `tile_rows`: the largest window `T`.
    - `min_tile_rows`: the smallest window and the granularity.
    - `num_rows`: `M`; no window may be larger.
    - `steps`: sizes per doubling (1: powers of two).

    **Returns:**

    A non-empty tuple of ascending ints whose last entry is the full-window size.
    """
    top = max(1, min(tile_rows, num_rows))
    unit = max(1, min_tile_rows)
    sizes = []
    size = unit
    while size < top:
        sizes.append(size)
        size += max(unit, (1 << (size.bit_length() - 1)) // steps)
    sizes.append(top)
    return tuple(sizes)


def _row_mask(size, start, row_start, group_end):
    rows = start + jnp.arange(size, dtype=jnp.int32)
    return (rows >= row_start) & (rows < group_end)


def _for_each_window(ladder, group_sizes, num_rows, body, init, remainder_first=False):
    """Folds `body(carry, g, size, start, row_start, group_end, full, first)` over
    windows.

    Per group `g`: the full windows of `ladder[-1]` rows and one remainder window (if
    any). `start` is where a window is read (clamped into `[0, num_rows - size]`),
    `row_start` the first row it owns, `group_end` one past the last row it may own;
    `full` (static) says the window lies inside its group with `start == row_start`,
    so it needs no mask. With `remainder_first` the remainder (`1..T` rows) comes
    first and `first` (static) is True for it: it is then the first window of every
    non-empty group. Otherwise the remainder (`0..T-1` rows) comes last and `first`
    is always False.
    """
    group_sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    big = ladder[-1]
    ladder_arr = jnp.asarray(np.asarray(ladder, np.int32))

    def group_body(g, carry):
        size = group_sizes[g]
        if remainder_first:
            num_full = jnp.maximum(size - 1, 0) // big
            rest = size - num_full * big
            rest_start = starts[g]
            full_start = rest_start + rest
        else:
            num_full = size // big
            rest = size - num_full * big
            full_start = starts[g]
            rest_start = full_start + num_full * big
        rest_end = rest_start + rest

        def full_body(i, c):
            row_start = full_start + i * big
            return body(c, g, big, row_start, row_start, row_start + big, True, False)

        def remainder(c):
            # The remainder window is the smallest ladder entry >= rest, selected with
            # 0-or-1-trip loops. `lax.switch` was measured 6x (forward) to 13x
            # (`d_rhs`) slower at G=64 on XLA:CPU: the conditional copies the carry.
            choice = jnp.searchsorted(ladder_arr, rest, side="left")
            for j, w in enumerate(ladder):

                def window_body(i, c, w=w):
                    # `i` is always 0, but without it the body is loop-invariant and
                    # XLA hoists it out of the loop, running every ladder size for
                    # every group.
                    first = rest_start + i
                    start = jnp.minimum(first, num_rows - w)
                    return body(c, g, w, start, first, rest_end, False, remainder_first)

                trips = ((rest > 0) & (choice == j)).astype(jnp.int32)
                c = lax.fori_loop(0, trips, window_body, c)
            return c

        if remainder_first:
            carry = remainder(carry)
        carry = lax.fori_loop(0, num_full, full_body, carry)
        if not remainder_first:
            carry = remainder(carry)
        return carry

    return lax.fori_loop(0, group_sizes.shape[0], group_body, init)


def _grouped_product(lhs, rhs, group_sizes, ladder, transpose_rhs):
    """`out[i] = lhs[i] @ rhs[g(i)]` (or `rhs[g(i)].T`); rows past the groups are 0."""
    num_rows = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]

    def body(out, g, size, start, row_start, group_end, full, first):
        del first
        x = lax.dynamic_slice_in_dim(lhs, start, size)
        y = lax.dot_general(
            x,
            rhs[g],
            (((1,), (1 if transpose_rhs else 0,)), ((), ())),
            preferred_element_type=acc_dtype(lhs.dtype),
        ).astype(out.dtype)
        if not full:
            # A clamped or partial window overlaps rows owned by other windows (or by
            # no group, which stay zero): keep what is there.
            keep = _row_mask(size, start, row_start, group_end)[:, None]
            y = jnp.where(keep, y, lax.dynamic_slice_in_dim(out, start, size))
        return lax.dynamic_update_slice_in_dim(out, y, start, 0)

    (out, _) = match_varying(jnp.zeros((num_rows, n), lhs.dtype), lhs)
    return _for_each_window(ladder, group_sizes, num_rows, body, out)


def _grouped_outer(lhs, d_out, group_sizes, ladder, init, accumulate):
    """`lhs_g^T @ d_out_g` for every group, in `init.dtype`, written window by window
    into `init` (in place: no second `[G, K, N]` buffer): added to it with
    `accumulate`, else overwriting it (groups without rows keep `init`'s value)."""
    num_rows = lhs.shape[0]
    acc_dtype = init.dtype

    def body(d_rhs, g, size, start, row_start, group_end, full, first):
        x = lax.dynamic_slice_in_dim(lhs, start, size)
        if not full:
            keep = _row_mask(size, start, row_start, group_end)[:, None]
            x = jnp.where(keep, x, jnp.zeros((), x.dtype))
        dy = lax.dynamic_slice_in_dim(d_out, start, size)
        total = jnp.matmul(x.T, dy, preferred_element_type=acc_dtype)
        if accumulate or not first:
            total = lax.dynamic_index_in_dim(d_rhs, g, 0, keepdims=False) + total
        return lax.dynamic_update_index_in_dim(d_rhs, total, g, 0)

    (init, _) = match_varying(init, lhs)
    # Without `accumulate` the first window of a group overwrites its block instead of
    # adding to zeros: at G=64 (benchmarks/gmm.py) that skips reading 128 MB, ~5% of
    # the `d_rhs` time.
    return _for_each_window(
        ladder, group_sizes, num_rows, body, init, remainder_first=not accumulate
    )


def _make_tiled_gmm(ladder: tuple[int, ...]):
    def forward(lhs, rhs, group_sizes):
        return _grouped_product(lhs, rhs, group_sizes, ladder, False)

    @jax.custom_vjp
    def tiled(lhs, rhs, group_sizes):
        return forward(lhs, rhs, group_sizes)

    def tiled_fwd(lhs, rhs, group_sizes):
        return forward(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def tiled_bwd(res, d_out):
        lhs, rhs, group_sizes = res
        d_out = d_out.astype(lhs.dtype)
        d_lhs = _grouped_product(d_out, rhs, group_sizes, ladder, True)
        zeros = jnp.zeros(rhs.shape, acc_dtype(lhs.dtype))
        d_rhs = _grouped_outer(lhs, d_out, group_sizes, ladder, zeros, False)
        d_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
        return d_lhs, d_rhs.astype(rhs.dtype), d_sizes

    tiled.defvjp(tiled_fwd, tiled_bwd)

    @jax.custom_vjp
    def accumulating(lhs, rhs, group_sizes, rhs_grad_acc):
        del rhs_grad_acc
        return forward(lhs, rhs, group_sizes)

    def accumulating_fwd(lhs, rhs, group_sizes, rhs_grad_acc):
        out = forward(lhs, rhs, group_sizes)
        return out, (lhs, rhs, group_sizes, rhs_grad_acc)

    def accumulating_bwd(res, d_out):
        lhs, rhs, group_sizes, acc = res
        d_out = d_out.astype(lhs.dtype)
        d_lhs = _grouped_product(d_out, rhs, group_sizes, ladder, True)
        d_acc = _grouped_outer(lhs, d_out, group_sizes, ladder, acc, True)
        d_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
        return d_lhs, None, d_sizes, d_acc

    accumulating.defvjp(accumulating_fwd, accumulating_bwd)
    return tiled, accumulating


_CACHE: dict = {}


def tiled_gmm(
    lhs: Float[Array, "rows k_dim"],
    rhs: Float[Array, "groups k_dim n_dim"],
    group_sizes: Int[Array, " groups"],
    tile_rows: int = DEFAULT_TILE_ROWS,
    min_tile_rows: int = DEFAULT_MIN_TILE_ROWS,
    ladder_steps: int | None = None,
    rhs_grad_acc: Float[Array, "groups k_dim n_dim"] | None = None,
) -> Float[Array, "rows n_dim"]:
    """The tiled grouped matmul as a function; see `TiledGMM` for the arguments (and
    `AbstractGMMBackend.accumulating` for `rhs_grad_acc`)."""
    num_rows = lhs.shape[0]
    if ladder_steps is None:
        ladder_steps = 2 if num_rows >= _FINE_LADDER_ROWS else 1
    ladder = window_ladder(tile_rows, min_tile_rows, num_rows, ladder_steps)
    fns = _CACHE.get(ladder)
    if fns is None:
        # One custom_vjp per ladder, so that traces are cached by JAX.
        fns = _CACHE[ladder] = _make_tiled_gmm(ladder)
    plain, accumulating = fns
    # Under shard_map the primals must share their varying axes; the transpose of the
    # cast (a psum) then sums `d_rhs` over shards for a replicated `rhs`.
    group_sizes = group_sizes.astype(jnp.int32)
    if rhs_grad_acc is None:
        return plain(*match_varying(lhs, rhs, group_sizes))
    return accumulating(*match_varying(lhs, rhs, group_sizes, rhs_grad_acc))


class TiledGMM(AbstractAccumulatingGMMBackend):
    """Grouped matmul as a loop of dense row windows that never straddle a group.

    Pure JAX (`lax.fori_loop`s whose trip counts come from the traced `group_sizes`),
    with its own backward (`jax.custom_vjp`): `d_lhs = gmm(d_out, rhs^T)` over the same
    windows, and `d_rhs[g] = lhs_g^T @ d_out_g` summed window by window in float32.
    Extra memory: one window's product, plus a float32 `d_rhs` in the backward when
    `rhs` is not float32.

    **Arguments:**

    - `tile_rows`: the largest window in rows: groups are covered by full windows of
        this size plus one smaller window.
    - `min_tile_rows`: the smallest window and the granularity of the ladder.
    - `ladder_steps`: window sizes per doubling between them (2: a window for more
        than `2 * min_tile_rows` rows is under a third padding; 1: under half, with
        fewer loops to compile); `None` picks 2 for `M >= 2048` rows and 1 below.
    """

    tile_rows: int = eqx.field(static=True, default=DEFAULT_TILE_ROWS)
    min_tile_rows: int = eqx.field(static=True, default=DEFAULT_MIN_TILE_ROWS)
    ladder_steps: int | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.tile_rows < 1 or self.min_tile_rows < 1:
            raise ValueError(
                f"`tile_rows` and `min_tile_rows` must be positive, got "
                f"{self.tile_rows} and {self.min_tile_rows}."
            )
        if self.min_tile_rows > self.tile_rows:
            raise ValueError(
                f"`min_tile_rows` ({self.min_tile_rows}) must not exceed `tile_rows` "
                f"({self.tile_rows})."
            )
        if self.ladder_steps is not None and self.ladder_steps < 1:
            raise ValueError(f"`ladder_steps` must be >= 1, got {self.ladder_steps}.")

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        return self._gmm(lhs, rhs, group_sizes, None)

    def accumulating(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
        rhs_grad_acc: Float[Array, "groups k_dim n_dim"],
    ) -> Float[Array, "rows n_dim"]:
        # `d_rhs` is summed window by window straight into the accumulator.
        return self._gmm(lhs, rhs, group_sizes, rhs_grad_acc)

    def _gmm(self, lhs, rhs, group_sizes, rhs_grad_acc):
        with jax.named_scope("moe_eqx.gmm.tiled"):
            return tiled_gmm(
                lhs,
                rhs,
                group_sizes,
                self.tile_rows,
                self.min_tile_rows,
                self.ladder_steps,
                rhs_grad_acc,
            )
