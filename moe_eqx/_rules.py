"""Rules that several stages share, each written once."""

import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

# `jax.ad_checkpoint.checkpoint_name` names of the layer's large intermediates, for
# `jax.checkpoint` policies (`save_only_these_names(...)`, ...).
DISPATCHED = "moe_dispatched"  # [pairs, d_model] rows entering the experts
HIDDEN = "moe_hidden"  # [pairs, 2 d_ff] the experts' first product, pre-activation
EXPERT_OUT = "moe_expert_out"  # [pairs, d_model] the experts' outputs
REMAT_NAMES = (DISPATCHED, HIDDEN, EXPERT_OUT)


def remat_name(a, name: str):
    """`a` named `name` for `jax.checkpoint` policies (one of `REMAT_NAMES`)."""
    return checkpoint_name(a, name)


def local_experts(num_experts: int, num_shards: int, *, shards: str = "shards") -> int:
    """`L = E / R`, home experts per shard; a `ValueError` unless `R` divides `E`.

    **Arguments:**

    - `num_experts`: `E`.
    - `num_shards`: `R`.
    - `shards`: how the caller's message names `R` (e.g. a mesh axis).
    """
    if num_shards < 1 or num_experts % num_shards:
        raise ValueError(
            f"`num_experts` ({num_experts}) must be divisible by the number of "
            f"{shards} ({num_shards})."
        )
    return num_experts // num_shards


def per_token_counts(*, top_k: int, local_groups: int, dedup: bool) -> tuple[int, int]:
    """`(pairs, wire rows)` one token can send to one shard at most: `min(k, G)` pairs
    (a shard holds at most `G = L + S` of its experts: `local_groups`, the groups of its
    grouped matmul), in one row when deduplicating."""
    pairs = min(top_k, local_groups)
    return pairs, 1 if dedup else pairs


def zeros_in_own_buffer(shape, dtype, runtime: jax.Array, *like) -> jax.Array:
    """`jnp.zeros(shape, dtype)` in a buffer of its own, for a user that writes into
    it in place (a loop's carry, a scatter).

    XLA merges equal broadcasts of a constant into one buffer, then copies that
    buffer for each such user: a read and a write of the whole array each, where a
    fill is one write, and the shared buffer stays alive from the first user to the
    last. Here the zero is `min(max(r + c, 0), 0)`, which XLA cannot prove is zero,
    so it is not merged: `r` is the first element of `runtime`, any integer array
    known only at run time (counts, indices), and `c` a constant that differs
    between every two calls (a counter: equal expressions are merged too, so no two
    zeros may share one, and no caller chooses it). The value is 0 whatever
    `runtime` holds. Inside `shard_map` it varies over the manual axes of `runtime`
    and of the arrays `like` (see `match_varying`)."""
    salt = next(_SALTS) % 65521 + 1
    first = jnp.sum(jnp.ravel(runtime)[:1].astype(jnp.int32))
    zero = jnp.minimum(jnp.maximum(first + salt, 0), 0)
    zeros = jnp.broadcast_to(zero.astype(dtype), shape)
    return match_varying(zeros, *like)[0] if like else zeros


_SALTS = itertools.count()


# Index arithmetic on short arrays (shards, groups, experts) as fused compares and
# reductions: `jnp.cumsum` (a reduce-window), `jnp.searchsorted` (a loop) and
# histograms by scatter-add are each kernels of their own for XLA:CPU to compile,
# several times over in a layer's forward and backward.


def div(x: jax.Array, n: int) -> jax.Array:
    """`x // n` for non-negative integers `x` and `n > 0`: one `lax.div` (truncating,
    equal to floor division there) instead of `jnp.floor_divide`'s sign corrections
    (about a dozen ops each, compiled every time)."""
    return lax.div(x, jnp.asarray(n, x.dtype))


def rem(x: jax.Array, n: int) -> jax.Array:
    """`x % n` for non-negative integers `x` and `n > 0` (`lax.rem`; see `div`)."""
    return lax.rem(x, jnp.asarray(n, x.dtype))


def cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    """Inclusive cumulative sum along `axis` of a short array (`O(n^2)` work)."""
    x = jnp.moveaxis(x, axis, -1)
    i = jnp.arange(x.shape[-1], dtype=jnp.int32)
    upper = i[:, None] <= i[None, :]  # [j, i]: element j counts towards i
    upper = upper.reshape((1,) * (x.ndim - 1) + upper.shape)
    terms = jnp.where(upper, x[..., :, None], jnp.zeros((), x.dtype))
    out = jnp.sum(terms, axis=-2, dtype=x.dtype)
    return jnp.moveaxis(out, -1, axis)


def exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    """`cumsum(x, axis) - x`."""
    return cumsum(x, axis) - x


def pick_columns(table: jax.Array, index: jax.Array) -> jax.Array:
    """`table[r, index[r, j]]`: `table` `[R, C]` (or `[1, C]`, one row for all) and
    `index` `[R, k]` int in `[0, C)` give `[R, k]`. On a TPU a masked sum over the
    `C` columns (one fused pass, its backward another): there a gather of single
    numbers costs per number, and its backward is a scatter-add (docs/measured.md).
    Elsewhere the gather: XLA:CPU would materialise the `[R, k, C]` mask. The two
    are equal, values and derivatives: each sum has one term."""
    return jax.lax.platform_dependent(
        table, index, tpu=_masked_pick, default=_gathered_pick
    )


def _masked_pick(table, index):
    columns = jnp.arange(table.shape[-1], dtype=index.dtype).reshape(1, 1, -1)
    mine = index[:, :, None] == columns
    picked = jnp.where(mine, table[:, None, :], jnp.zeros((), table.dtype))
    return jnp.sum(picked, axis=-1)


def _gathered_pick(table, index):
    if table.shape[0] == 1:  # one table for every row
        return table[0][index]
    return jnp.take_along_axis(table, index, axis=-1)


def histogram(index: jax.Array, size: int) -> jax.Array:
    """`[size]` int32 counts of each value `0..size-1` in `index` (other values are
    not counted)."""
    bins = jnp.arange(size, dtype=jnp.int32)
    return jnp.sum(index.reshape(-1)[:, None] == bins[None, :], axis=0, dtype=jnp.int32)


def count_at_or_below(boundaries: jax.Array, values: jax.Array) -> jax.Array:
    """For each value, how many `boundaries` are `<=` it: `searchsorted(boundaries,
    values, side="right")` for sorted `boundaries`."""
    return jnp.sum(boundaries[None, :] <= values[:, None], axis=1, dtype=jnp.int32)


def all_to_all(x: jax.Array, axis_name, *, materialise: bool = True) -> jax.Array:
    """`lax.all_to_all` of `[R, ...]` blocks (block `d` to shard `d`).

    XLA cuts the operand into `R` slices and fuses `x`'s producer into each of them,
    compiling (not running) that producer `R` times. With `materialise`, `x` is first
    written by a scatter, which XLA does not fuse into its consumers (XLA:CPU drops
    `lax.optimization_barrier`s before fusion); pass `False` when `x` already comes
    from one."""
    if materialise:
        # Row by row (the blocks' rows flattened): a scatter of whole blocks first
        # copies them into the layout of its updates.
        flat = x.reshape(-1, *x.shape[2:]) if x.ndim > 1 else x
        rows = jnp.arange(flat.shape[0], dtype=jnp.int32)
        flat = (
            jnp.zeros_like(flat)
            .at[rows]
            .set(flat, unique_indices=True, indices_are_sorted=True)
        )
        x = flat.reshape(x.shape)
    return lax.all_to_all(x, axis_name, 0, 0, tiled=False)


def acc_dtype(dtype) -> jnp.dtype:
    """Accumulation dtype of the grouped matmuls and weight gradients: float32, except
    that float64 inputs (x64 mode) keep float64."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # older jax


def match_varying(*xs):
    """Casts arrays (or PyTrees of them) to vary over the union of their `shard_map` manual axes.

    Inside `jax.shard_map`, loop carries and `custom_linear` operands must agree on
    which mesh axes they vary over: a zero-initialised carry does not vary, while a
    carry computed from sharded rows does. Outside `shard_map` this is the identity.
    """
    leaves = jax.tree.leaves(xs)
    axes = frozenset().union(*(_varying_axes(x) for x in leaves))

    def cast(x):
        missing = tuple(sorted(axes - _varying_axes(x)))
        if not missing:
            return x
        if hasattr(lax, "pcast"):
            return lax.pcast(x, missing, to="varying")
        return lax.pvary(x, missing)  # jax < 0.8

    # A PyTree argument (a quantized weight) is cast leaf by leaf.
    return tuple(jax.tree.map(cast, x) for x in xs)


def has_explicit_axes(mesh) -> bool:
    """Whether `mesh` has an Explicit axis (`jax.make_mesh`'s default in recent jax):
    reshapes and gathers along explicitly sharded axes must name their output
    sharding."""
    types = getattr(mesh, "axis_types", None) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)
