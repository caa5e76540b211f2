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

The backward is one loop over groups: each window gives its `d_lhs` rows and adds its
`lhs^T @ d_out` into a `[K, N]` block that is stored once per group. At G=64 on that
CPU the three passes are bound by the products themselves: 64 products of 64 rows
take 1.4-1.5x one dense product of 4096 rows whether their weights come from memory
or cache, and neither a finer ladder (less padding) nor the other XLA:CPU dot kernel
for `d_rhs` gained more than ~5%. Returning the 128 MB `d_rhs` also costs first-touch
page faults of a fresh allocation (60-90 ms; see benchmarks/gmm.py), more than all
its FLOPs.
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


def _group_windows(ladder, size, group_start, num_rows, body, carry, remainder_first):
    """Folds `body(carry, size, start, row_start, group_end, full, first)` over the
    windows of one group of `size` rows from row `group_start`.

    The full windows of `ladder[-1]` rows and one remainder window (if any). `start` is
    where a window is read (clamped into `[0, num_rows - size]`), `row_start` the first
    row it owns, `group_end` one past the last row it may own; `full` (static) says the
    window lies inside its group with `start == row_start`, so it needs no mask. With
    `remainder_first` the remainder (`1..T` rows) comes first and `first` (static) is
    True for it: it is then the first window of every non-empty group. Otherwise the
    remainder (`0..T-1` rows) comes last and `first` is always False.
    """
    big = ladder[-1]
    if remainder_first:
        num_full = jnp.maximum(size - 1, 0) // big
        rest = size - num_full * big
        rest_start = group_start
        full_start = rest_start + rest
    else:
        num_full = size // big
        rest = size - num_full * big
        full_start = group_start
        rest_start = full_start + num_full * big
    rest_end = rest_start + rest

    def full_body(i, c):
        row_start = full_start + i * big
        return body(c, big, row_start, row_start, row_start + big, True, False)

    def remainder(c):
        # The remainder window is the smallest ladder entry >= rest, selected with
        # 0-or-1-trip loops. `lax.switch` was measured 6x (forward) to 13x
        # (`d_rhs`) slower at G=64 on XLA:CPU: the conditional copies the carry.
        choice = jnp.searchsorted(jnp.asarray(np.asarray(ladder, np.int32)), rest)
        for j, w in enumerate(ladder):

            def window_body(i, c, w=w):
                # `i` is always 0, but without it the body is loop-invariant and
                # XLA hoists it out of the loop, running every ladder size for
                # every group.
                first = rest_start + i
                start = jnp.minimum(first, num_rows - w)
                return body(c, w, start, first, rest_end, False, remainder_first)

            trips = ((rest > 0) & (choice == j)).astype(jnp.int32)
            c = lax.fori_loop(0, trips, window_body, c)
        return c

    if remainder_first:
        carry = remainder(carry)
    carry = lax.fori_loop(0, num_full, full_body, carry)
    if not remainder_first:
        carry = remainder(carry)
    return carry


def _for_each_group(group_sizes, body, init):
    """Folds `body(carry, g, size, group_start)` over the groups."""
    group_sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def group_body(g, carry):
        return body(carry, g, group_sizes[g], starts[g])

    return lax.fori_loop(0, group_sizes.shape[0], group_body, init)


def _product_window(lhs, w, out, size, start, row_start, group_end, full, transpose):
    """`out` with the window's rows replaced by `lhs[rows] @ w` (or `w.T`)."""
    x = lax.dynamic_slice_in_dim(lhs, start, size)
    y = lax.dot_general(
        x,
        w,
        (((1,), (1 if transpose else 0,)), ((), ())),
        preferred_element_type=acc_dtype(lhs.dtype),
    ).astype(out.dtype)
    if not full:
        # A clamped or partial window overlaps rows owned by other windows (or by no
        # group, which stay zero): keep what is there.
        keep = _row_mask(size, start, row_start, group_end)[:, None]
        y = jnp.where(keep, y, lax.dynamic_slice_in_dim(out, start, size))
    return lax.dynamic_update_slice_in_dim(out, y, start, 0)


def _outer_window(lhs, d_out, total, size, start, row_start, group_end, full, first):
    """`total + lhs[rows]^T @ d_out[rows]` over the rows the window owns (just the
    product for a group's `first` window: `total` is then stale)."""
    x = lax.dynamic_slice_in_dim(lhs, start, size)
    if not full:
        keep = _row_mask(size, start, row_start, group_end)[:, None]
        x = jnp.where(keep, x, jnp.zeros((), x.dtype))
    dy = lax.dynamic_slice_in_dim(d_out, start, size)
    product = jnp.matmul(x.T, dy, preferred_element_type=total.dtype)
    return product if first else total + product


def _grouped_product(lhs, rhs, group_sizes, ladder):
    """`out[i] = lhs[i] @ rhs[g(i)]`; rows past the groups are 0."""
    num_rows = lhs.shape[0]

    def group(out, g, size, group_start):
        w = rhs[g]

        def window(out, size, start, row_start, group_end, full, first):
            del first
            return _product_window(
                lhs, w, out, size, start, row_start, group_end, full, False
            )

        return _group_windows(ladder, size, group_start, num_rows, window, out, False)

    (out, _) = match_varying(jnp.zeros((num_rows, rhs.shape[2]), lhs.dtype), lhs)
    if num_rows == 0:  # no window fits
        return out
    return _for_each_group(group_sizes, group, out)


def _grouped_backward(lhs, rhs, d_out, group_sizes, ladder, rhs_grad_acc):
    """`d_lhs[i] = d_out[i] @ rhs[g(i)].T` and `d_rhs[g] = lhs_g^T @ d_out_g` in one
    pass over the windows (each `d_out` window is read once for both).

    `d_rhs` is summed in `acc_dtype` and written in place into `rhs_grad_acc` (added to
    it) if given, else into a zero-initialised buffer. A group's block is summed over
    its windows in a `[K, N]` scratch loop carry (2 MB at K=512, N=1024: in cache)
    and stored once, so the `[G, K, N]` buffer is written once per group, not read
    and written once per window.
    """
    num_rows = lhs.shape[0]
    accumulate = rhs_grad_acc is not None
    if rhs_grad_acc is None:
        rhs_grad_acc = jnp.zeros(rhs.shape, acc_dtype(lhs.dtype))

    def group(carry, g, size, group_start):
        d_lhs, d_rhs, scratch = carry
        if accumulate:
            scratch = lax.dynamic_index_in_dim(d_rhs, g, 0, keepdims=False)
        w = rhs[g]

        def window(carry, size, start, row_start, group_end, full, first):
            d_lhs, scratch = carry
            where = (size, start, row_start, group_end, full)
            d_lhs = _product_window(d_out, w, d_lhs, *where, True)
            return d_lhs, _outer_window(lhs, d_out, scratch, *where, first)

        # Without `accumulate` a group's first window overwrites the scratch (what the
        # previous group left there) instead of adding to zeros.
        carry = (d_lhs, scratch)
        first_writes = not accumulate
        (d_lhs, scratch) = _group_windows(
            ladder, size, group_start, num_rows, window, carry, first_writes
        )
        block = scratch if accumulate else jnp.where(size > 0, scratch, 0)
        d_rhs = lax.dynamic_update_index_in_dim(d_rhs, block, g, 0)
        return d_lhs, d_rhs, scratch

    d_lhs = jnp.zeros(lhs.shape, lhs.dtype)
    scratch = jnp.zeros(rhs.shape[1:], rhs_grad_acc.dtype)
    init = match_varying(d_lhs, rhs_grad_acc, scratch, lhs, d_out)[:3]
    if num_rows == 0:  # no window fits
        return init[:2]
    (d_lhs, d_rhs, _) = _for_each_group(group_sizes, group, init)
    return d_lhs, d_rhs


def _make_tiled_gmm(ladder: tuple[int, ...]):
    def forward(lhs, rhs, group_sizes):
        return _grouped_product(lhs, rhs, group_sizes, ladder)

    @jax.custom_vjp
    def tiled(lhs, rhs, group_sizes):
        return forward(lhs, rhs, group_sizes)

    def tiled_fwd(lhs, rhs, group_sizes):
        return forward(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def tiled_bwd(res, d_out):
        lhs, rhs, group_sizes = res
        d_out = d_out.astype(lhs.dtype)
        d_lhs, d_rhs = _grouped_backward(lhs, rhs, d_out, group_sizes, ladder, None)
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
        d_lhs, d_acc = _grouped_backward(lhs, rhs, d_out, group_sizes, ladder, acc)
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
    with its own backward (`jax.custom_vjp`): one pass over the same windows computes
    `d_lhs = gmm(d_out, rhs^T)` and `d_rhs[g] = lhs_g^T @ d_out_g`, summed over a
    group's windows in float32. Extra memory: one window's product and one `[K, N]`
    float32 block, plus a float32 `d_rhs` in the backward when `rhs` is not float32.

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
        # Each group's `d_rhs` block is added straight into the accumulator.
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
