"""A tiled grouped matmul in pure JAX: the fast backend on CPU (and the fallback on GPU).

Each group is cut into row windows that never straddle a group boundary, so every
window is one dense `[rows, K] @ [K, N]` product with its group's matrix. A group of
`s` rows takes `s // T` full windows of the largest size `T`, then one window for the
remainder `r`, whose size is the smallest entry `>= r` of a static ladder
(`8, 12, 16, 24, 32, 48, ...` up to `T`), picked with 0-or-1-trip `lax.fori_loop`s. So there are at most
`s // T + 1` products per group and at most a third of the remainder's rows is wasted.
All trip counts and branch choices come from the traced `group_sizes`, so one compiled
program serves every routing.

Few, large products matter on CPU: measured on 2 cores (M=4096, K=512, N=1024), a loop
of 64-row products runs at ~70% of one big matmul and 16-row ones at ~35%, and in the
`d_rhs` pass every extra product also costs a `[K, N]` float32 accumulation, which at
these sizes takes as long as the product itself.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from ._base import AbstractGMMBackend

# Picked with benchmarks/gmm.py on a 2-core x86 CPU.
DEFAULT_TILE_ROWS = 512
DEFAULT_MIN_TILE_ROWS = 8


def window_ladder(tile_rows: int, min_tile_rows: int, num_rows: int) -> tuple[int, ...]:
    """The static window sizes: multiples of `min_tile_rows` with four steps per
    doubling (`8, 16, 24, ..., 64, 80, 96, 112, 128, 160, ...` for 8) up to
    `tile_rows`, capped at `num_rows`.

    **Arguments:**

    - `tile_rows`: the largest window `T`.
    - `min_tile_rows`: the smallest window and the granularity.
    - `num_rows`: `M`; no window may be larger.

    **Returns:**

    A non-empty tuple of ascending ints whose last entry is the full-window size.
    """
    top = max(1, min(tile_rows, num_rows))
    unit = max(1, min_tile_rows)
    sizes = []
    size = unit
    while size < top:
        sizes.append(size)
        size += max(unit, (1 << (size.bit_length() - 1)) // 4)
    sizes.append(top)
    return tuple(sizes)


def _row_mask(size, start, row_start, group_end):
    rows = start + jnp.arange(size, dtype=jnp.int32)
    return (rows >= row_start) & (rows < group_end)


def _for_each_window(ladder, group_sizes, num_rows, body, init, prepare, finish):
    """Folds `body(carry, aux, size, start, row_start, group_end, full)` over windows.

    Per group `g`: `aux = prepare(carry, g)`, the full windows of `ladder[-1]` rows,
    one remainder window (if any), then `carry = finish(carry, aux, g)`. `start` is
    where a window is read (clamped into `[0, num_rows - size]`), `row_start` the first
    row it owns, `group_end` one past its group's last row; `full` (static) says the
    window lies inside its group with `start == row_start`, so needs no mask.
    """
    group_sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    big = ladder[-1]
    ladder_arr = jnp.asarray(np.asarray(ladder, np.int32))

    def group_body(g, carry):
        aux = prepare(carry, g)
        size = group_sizes[g]
        num_full = size // big
        end = ends[g]

        def full_body(i, c):
            row_start = starts[g] + i * big
            return body(c, aux, big, row_start, row_start, end, True)

        carry = lax.fori_loop(0, num_full, full_body, carry)
        rest = size - num_full * big
        row_start = starts[g] + num_full * big

        # The remainder window is the smallest ladder entry >= rest. Selected with
        # 0-or-1-trip loops, not `lax.switch`: XLA:CPU copies a conditional's operands
        # (the whole output here) on every call, measured 3-4x slower at G=64.
        choice = jnp.searchsorted(ladder_arr, rest, side="left")
        for j, w in enumerate(ladder):

            def window_body(i, c, w=w):
                # `i` is always 0, but without it the body is loop-invariant and XLA
                # hoists it out of the loop, running every ladder size for every group.
                first = row_start + i
                start = jnp.minimum(first, num_rows - w)
                return body(c, aux, w, start, first, end, False)

            trips = ((rest > 0) & (choice == j)).astype(jnp.int32)
            carry = lax.fori_loop(0, trips, window_body, carry)
        return finish(carry, aux, g)

    return lax.fori_loop(0, group_sizes.shape[0], group_body, init)


def _grouped_product(lhs, rhs, group_sizes, ladder, transpose_rhs):
    """`out[i] = lhs[i] @ rhs[g(i)]` (or `@ rhs[g(i)].T`); rows past the groups are 0."""
    num_rows = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]

    def prepare(out, g):
        # Sliced (and transposed) once per group, not once per window.
        return g

    def body(out, g, size, start, row_start, group_end, full):
        x = lax.dynamic_slice_in_dim(lhs, start, size)
        y = lax.dot_general(x, rhs[g], (((1,), (1 if transpose_rhs else 0,)), ((), ())), preferred_element_type=jnp.float32).astype(out.dtype)
        if not full:
            # A clamped or partial window overlaps rows owned by other windows (or by
            # no group, which stay zero): keep what is there.
            keep = _row_mask(size, start, row_start, group_end)[:, None]
            y = jnp.where(keep, y, lax.dynamic_slice_in_dim(out, start, size))
        return lax.dynamic_update_slice_in_dim(out, y, start, 0)

    out = jnp.zeros((num_rows, n), lhs.dtype)
    return _for_each_window(
        ladder, group_sizes, num_rows, body, out, prepare, lambda c, a, g: c
    )


def _grouped_outer(lhs, d_out, group_sizes, ladder, rhs_dtype):
    """`d_rhs[g] = lhs_g^T @ d_out_g` for every group (zero for empty groups)."""
    num_rows, k = lhs.shape
    n = d_out.shape[1]
    num_groups = group_sizes.shape[0]

    def prepare(carry, g):
        return None

    def body(carry, aux, size, start, row_start, group_end, full):
        d_rhs, acc = carry
        x = lax.dynamic_slice_in_dim(lhs, start, size)
        if not full:
            keep = _row_mask(size, start, row_start, group_end)[:, None]
            x = jnp.where(keep, x, jnp.zeros((), x.dtype))
        dy = lax.dynamic_slice_in_dim(d_out, start, size)
        prod = lax.dot_general(
            x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return d_rhs, acc + prod

    def finish(carry, aux, g):
        d_rhs, acc = carry
        d_rhs = lax.dynamic_update_index_in_dim(d_rhs, acc.astype(rhs_dtype), g, 0)
        return d_rhs, jnp.zeros_like(acc)

    init = (jnp.zeros((num_groups, k, n), rhs_dtype), jnp.zeros((k, n), jnp.float32))
    d_rhs, _ = _for_each_window(
        ladder, group_sizes, num_rows, body, init, prepare, finish
    )
    return d_rhs


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
        d_rhs = _grouped_outer(lhs, d_out, group_sizes, ladder, rhs.dtype)
        d_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
        return d_lhs, d_rhs, d_sizes

    tiled.defvjp(tiled_fwd, tiled_bwd)
    return tiled


_CACHE: dict = {}


def tiled_gmm(
    lhs: Float[Array, "rows k_dim"],
    rhs: Float[Array, "groups k_dim n_dim"],
    group_sizes: Int[Array, " groups"],
    tile_rows: int = DEFAULT_TILE_ROWS,
    min_tile_rows: int = DEFAULT_MIN_TILE_ROWS,
) -> Float[Array, "rows n_dim"]:
    """The tiled grouped matmul as a function; see `TiledGMM`."""
    ladder = window_ladder(tile_rows, min_tile_rows, lhs.shape[0])
    fn = _CACHE.get(ladder)
    if fn is None:
        # One custom_vjp per ladder, so that traces are cached by JAX.
        fn = _CACHE[ladder] = _make_tiled_gmm(ladder)
    return fn(lhs, rhs, group_sizes.astype(jnp.int32))


class TiledGMM(AbstractGMMBackend):
    """Grouped matmul as a loop of dense row windows that never straddle a group.

    Pure JAX (`lax.fori_loop`/`lax.switch` driven by the traced `group_sizes`), with
    its own backward (`jax.custom_vjp`): `d_lhs = gmm(d_out, rhs^T)` over the same
    windows and `d_rhs[g] = lhs_g^T @ d_out_g` accumulated in float32. Memory beyond
    inputs and outputs: one window and, in the backward, one `[K, N]` accumulator.

    **Arguments:**

    - `tile_rows`: the largest window, in rows (groups are covered by full windows of
        this size plus one smaller window).
    - `min_tile_rows`: the smallest window; the ladder between them grows by 1.5x/1.33x,
        so a remainder window wastes at most a third of its rows.
    """

    tile_rows: int = eqx.field(static=True, default=DEFAULT_TILE_ROWS)
    min_tile_rows: int = eqx.field(static=True, default=DEFAULT_MIN_TILE_ROWS)

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

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        with jax.named_scope("moe_eqx.gmm.tiled"):
            return tiled_gmm(
                lhs, rhs, group_sizes, self.tile_rows, self.min_tile_rows
            )
