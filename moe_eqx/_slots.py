"""Slot weights of duplicated experts, as an explicit `custom_vjp`.

Forward: each home shard exports the experts it owns that sit in some shard's slots;
one `all_to_all` of `[R, S, ...]` blocks delivers each shard exactly its `S` slot
experts (volume bounded by the plan's `R * S` slots, never by `E`). Backward: the slot
gradients `[S, ...]` are all-gathered, and each home shard scatter-adds the ones it owns
into its `[L, ...]` home gradient. No global `[E, ...]` gradient is ever built or
psum-ed.
"""

import functools as ft

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def _owned(slot_expert, num_local, axis_name):
    me = jax.lax.axis_index(axis_name)
    owner = jnp.where(slot_expert >= 0, slot_expert // num_local, -1)
    local = jnp.clip(slot_expert % num_local, 0, num_local - 1)
    return owner == me, local


def _bcast(mask, like):
    return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))


@ft.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def gather_slot_weights(
    w_home: Float[Array, "local_experts ..."],
    slot_expert: Int[Array, "shards slots"],
    num_local: int,
    axis_name: str,
) -> Float[Array, "slots ..."]:
    """Fetches the weights of this shard's slot experts from their home shards.

    Called inside `shard_map` over `axis_name`.

    **Arguments:**

    - `w_home`: `[L, ...]` this shard's home expert weights.
    - `slot_expert`: `[R, S]` the plan's slot table (identical on all shards; -1 empty).
    - `num_local`: `L`.
    - `axis_name`: the expert-parallel axis.

    **Returns:**

    `[S, ...]` the weights of `slot_expert[me]` (zeros for empty slots).
    """
    owned, local = _owned(slot_expert, num_local, axis_name)
    send = jnp.where(_bcast(owned, w_home[local]), w_home[local], 0)  # [R, S, ...]
    recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=False)
    # Exactly one source holds each filled slot; the others sent zeros.
    return jnp.sum(recv, axis=0)


def _fwd(w_home, slot_expert, num_local, axis_name):
    out = gather_slot_weights(w_home, slot_expert, num_local, axis_name)
    # `w_home` is a parameter that is alive anyway; it only provides shape and dtype.
    return out, (slot_expert, w_home)


def _bwd(num_local, axis_name, res, g_slots):
    slot_expert, w_home = res
    shape, dtype = w_home.shape, w_home.dtype
    g_all = jax.lax.all_gather(g_slots, axis_name)  # [R, S, ...]
    owned, local = _owned(slot_expert, num_local, axis_name)
    g_all = jnp.where(_bcast(owned, g_all), g_all, 0)
    g_home = (
        jnp.zeros(shape, dtype)
        .at[local.ravel()]
        .add(g_all.reshape(-1, *shape[1:]).astype(dtype))
    )
    return g_home, None


gather_slot_weights.defvjp(_fwd, _bwd)
