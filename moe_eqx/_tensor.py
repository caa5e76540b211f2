"""Expert tensor parallelism: every expert's hidden width `d_ff` split over a mesh
axis (`MoEConfig(tensor_axis=...)`), routed and shared experts alike.

Layout (what [`moe_eqx.shard_model`][] places; the parameters keep their one
layout, `w_gate_up = [gate | up]`): device `t` of the `P` devices of the tensor axis
holds the columns `[t, t + 1) * 2 d_ff / P` of `w_gate_up` (contiguous, as a
`PartitionSpec` splits an axis) and the rows `[t, t + 1) * d_ff / P` of `w_down`: its
`d_ff / P` hidden units `V_t`. Its columns are not `V_t`'s gate and up columns (with
`P = 2`, device 0 holds the whole gate, device 1 the whole up), so the first product
is regrouped before the activation (`TensorSplit`): cut into `2 P` blocks of
`d_ff / P` columns, block `j` (device `j // 2`'s) goes to device `j mod P`, which then
holds the gate and up columns of `V_t`. The `2 P` blocks form a 2-regular bipartite
graph between senders and receivers, so two `ppermute`s move them, each device
sending and receiving one block in each: the activations of the first product cross
the wire once (less the blocks a device keeps), never a weight.

The rows of a tensor group: the tokens are split over the tensor axis like over a
data axis, each group along it its own expert-parallel group, so a device receives
its rows from its own group. The devices of a tensor group all-gather their received
rows (`pooled`), compute every row with their `d_ff / P` hidden units, and
reduce-scatter the partial outputs: each gets the sum over the tensor axis of its
own rows (a reduce-scatter, not an all-reduce: each device needs only its rows, and
the reduce-scatter moves `1 / P` of the all-reduce's bytes). All devices of a group
then compute the same rows in the same order, so their collectives inside the
experts' loops match.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._activation import AbstractActivation, apply_activation


def _matchings(size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The `2 P` blocks of the first product (block `j`: sender `j // 2`, receiver
    `j mod P`) split into two perfect matchings of senders to receivers: a block per
    sender and per receiver in each. Each is a tuple of block indices."""
    blocks = list(range(2 * size))
    # Kuhn's augmenting paths for one perfect matching; the rest is the other (a
    # 2-regular bipartite multigraph less a perfect matching is one).
    match = {}  # receiver -> block

    def augment(sender, seen):
        for j in (2 * sender, 2 * sender + 1):
            r = j % size
            if r in seen:
                continue
            seen.add(r)
            if r not in match or augment(match[r] // 2, seen):
                match[r] = j
                return True
        return False

    for s in range(size):
        if not augment(s, set()):  # pragma: no cover - cannot happen (Hall)
            raise AssertionError(f"no perfect matching of {size} devices' blocks")
    first = tuple(sorted(match.values(), key=lambda j: j // 2))
    second = tuple(sorted(set(blocks) - set(first), key=lambda j: j // 2))
    return first, second


def regroup(
    h: Float[Array, "*rows width"], axis_name: str, size: int
) -> Float[Array, "*rows width"]:
    """Device `t`'s columns of the first product (`[t, t + 1) * 2 d_ff / P` of
    `[gate | up]`) as `[gate | up]` of its hidden units `V_t` (see the module)."""
    if size == 1:
        return h
    width = h.shape[-1] // 2
    blocks = h.reshape(*h.shape[:-1], 2, width)
    t = jax.lax.axis_index(axis_name)
    received = []
    is_gate = []
    for matching in _matchings(size):
        # This device sends its block `slot` (0 or 1) of this matching; it receives
        # a gate or an up block.
        slot = jnp.asarray([j % 2 for j in matching], jnp.int32)[t]
        role = jnp.asarray(
            [next(j < size for j in matching if j % size == r) for r in range(size)]
        )[t]
        payload = jnp.take(blocks, slot, axis=-2)
        perm = [(j // 2, j % size) for j in matching]
        received.append(jax.lax.ppermute(payload, axis_name, perm))
        is_gate.append(role)
    gate = jnp.where(is_gate[0], received[0], received[1])
    up = jnp.where(is_gate[0], received[1], received[0])
    return jnp.concatenate([gate, up], axis=-1)


class TensorSplit(AbstractActivation):
    """`inner` on the hidden units one device of the tensor axis holds: a gated
    activation's first product regrouped first (`regroup`), an ungated one's as
    given (its columns are already the device's hidden units). The layer wraps the
    experts' activation in it under `MoEConfig.tensor_axis`; `inner` must act on each
    hidden unit on its own (every built-in does), as it sees `d_ff / P` of them.

    A collective: backends run it between two whole products (never per window of
    rows), and every device of the axis calls it on the same rows."""

    inner: AbstractActivation = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    size: int = eqx.field(static=True)
    collective: ClassVar[bool] = True

    @property
    def gated(self) -> bool:
        return self.inner.gated

    def __call__(self, h):
        if self.inner.gated:
            h = regroup(h, self.axis_name, self.size)
        return apply_activation(self.inner, h)


def pooled(fn, axis_name: str, *rows):
    """`fn(*gathered)` over the rows of every device of the tensor axis (each
    `[N, ...]`, all-gathered to `[P N, ...]` in device order), its output `[P N, d]`
    summed over the axis and split back: this device's `[N, d]` rows (in float32,
    then `fn`'s dtype). `fn` may return `(out, *aux)`: the aux values are returned
    as they are."""
    gathered = [
        None if r is None else jax.lax.all_gather(r, axis_name, tiled=True)
        for r in rows
    ]
    result = fn(*gathered)
    out, aux = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    summed = jax.lax.psum_scatter(
        out.astype(jnp.float32), axis_name, scatter_dimension=0, tiled=True
    ).astype(out.dtype)
    return (summed, *aux) if aux else summed


def first_on_axis(a, axis_name: str):
    """`a` on the axis's first device, zeros on the others: a term (an output
    bias) added once to outputs summed over the axis."""
    first = jax.lax.axis_index(axis_name) == 0
    return jax.tree.map(
        lambda v: None if v is None else jnp.where(first, v, jnp.zeros((), v.dtype)),
        a,
        is_leaf=lambda v: v is None,
    )


def local_units(axis_name: str, size: int, total: int):
    """`(start, count)` of the hidden units (of `total`) this device holds."""
    count = total // size
    return jax.lax.axis_index(axis_name) * count, count


def tensor_size_here(axis_name: str | None, mesh_axes: tuple[str, ...]) -> int:
    """Inside `shard_map`: `P`, the devices of the tensor axis (1 without one). The
    axis must be one of the mesh's other axes (`mesh_axes`)."""
    if axis_name is None:
        return 1
    if axis_name not in mesh_axes:
        raise ValueError(
            f"`config.tensor_axis` {axis_name!r} is not one of the mesh's axes "
            f"besides the expert axis ({mesh_axes}): the experts' `d_ff` is split "
            "over it, so it must be a mesh axis the tokens are split over too."
        )
    return jax.lax.axis_size(axis_name)
