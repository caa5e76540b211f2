"""The exact overflow predicate, and the buffer factor a call would have needed."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._buffers import BufferSizes
from ._checks import check_array


def overflow_predicate(
    wire_counts: Int[Array, "shards shards"],
    pair_counts: Int[Array, "shards _"],
    buffers: BufferSizes,
) -> Bool[Array, ""]:
    """Exact overflow predicate: True iff some shard would receive more wire rows or more
    pairs than its buffers hold. Computed from all-gathered counts, so every shard gets
    the same answer.

    **Arguments:**

    - `wire_counts`: `[R, R]` wire rows from shard `s` (row) to shard `d` (column).
    - `pair_counts`: `[R, X]` pairs each shard (row) receives, split over any second
        axis: per local group, or per source shard (the layer passes the pairs each
        shard really dispatched to each other, transposed).
    - `buffers`: the [`moe_eqx.internal.BufferSizes`][].

    **Returns:**

    A boolean scalar.
    """
    where = "overflow_predicate"
    check_array("wire_counts", wire_counts, ndim=2, kind="int", where=where)
    num_shards = wire_counts.shape[0]
    check_array("wire_counts", wire_counts, shape=(num_shards, num_shards), where=where)
    check_array(
        "pair_counts", pair_counts, shape=(num_shards, None), kind="int", where=where
    )
    if not isinstance(buffers, BufferSizes):
        raise TypeError(
            f"{where}: `buffers` must be a `BufferSizes`, got {type(buffers).__name__}."
        )
    with jax.named_scope("moe_eqx.overflow"):
        recv_rows = jnp.sum(wire_counts, axis=0)
        recv_pairs = jnp.sum(pair_counts, axis=1)
        return jnp.any(recv_rows > buffers.rows) | jnp.any(recv_pairs > buffers.pairs)


def required_buffer_factor(
    wire_counts: Int[Array, "shards shards"],
    pair_counts: Int[Array, "shards _"],
    *,
    tokens: int,
    top_k: int,
) -> Float[Array, ""]:
    """The smallest `buffer_factor` with which this step would not have overflowed.

    **Arguments:**

    - `wire_counts`: `[R, R]` wire rows between shards.
    - `pair_counts`: `[R, X]` pairs received per shard (row), as for
        [`moe_eqx.overflow_predicate`][].
    - `tokens`: `T`, tokens per shard.
    - `top_k`: `k`.

    **Returns:**

    A float32 scalar: `max(max recv rows, max recv pairs) / (T * k)`.
    """
    need = jnp.maximum(
        jnp.max(jnp.sum(wire_counts, axis=0)), jnp.max(jnp.sum(pair_counts, axis=1))
    )
    return need.astype(jnp.float32) / jnp.asarray(tokens * top_k, jnp.float32)
