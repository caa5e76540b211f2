"""Slow re-placement of home experts (EPLB-style), on top of per-step slots.

The per-step planner ([`moe_eqx.plan_duplication`][]) moves load into `S` spare slots,
but home experts never move: with stable, skewed popularity, hot experts that share a
home shard keep it the straggler. Every few hundred steps a training loop can re-place
the experts on their home shards from the load of the last window:

```python
load = sum(stats.expert_counts over the window)          # [E] (or [layers, E])
model, opt_state = me.rebalance(model, opt_state, load, num_shards=R)
```

`layer.expert_ids[p]` is the logical expert held at physical position `p`
(`layer.experts.w_gate_up[p]` is expert `expert_ids[p]`; shard `p // L` holds it).
The router keeps logical ids, and so does its optional selection bias (and the bias's
state): nothing router-side is permuted. The layer maps each routed expert to its
physical position once, right after the router, so the planner, dispatch and grouped
matmuls work in physical order unchanged; `stats.expert_counts` stays logical.
"""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Int, PyTree

from ._layer import MoELayer
from ._rules import has_explicit_axes, local_experts

__all__ = [
    "permute_experts",
    "plan_placement",
    "rebalance",
    "rebalance_experts",
]


# ---------------------------------------------------------------------------------
# Placement: E experts into R shards of exactly L each.


def _to_host(x, name: str) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise ValueError(
            f"`{name}` is traced: re-placement is planned on the host between steps "
            "(outside `jit`); inside `jit` apply a precomputed placement with "
            "`moe_eqx.permute_experts`."
        )
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise ValueError(
                f"`{name}` is sharded across processes; pass a replicated array "
                "(e.g. `stats.expert_counts`, which is identical on every shard)."
            )
        x = x.addressable_data(0)
    return np.asarray(x)


def _check_load(expert_load, num_experts: int | None = None) -> np.ndarray:
    load = _to_host(expert_load, "expert_load")
    if load.ndim < 1 or load.shape[-1] == 0:
        raise ValueError(
            f"`expert_load` must be [..., num_experts], got shape {load.shape}."
        )
    if num_experts is not None and load.shape[-1] != num_experts:
        raise ValueError(
            f"`expert_load` has {load.shape[-1]} experts (shape {load.shape}), the "
            f"layer has {num_experts}."
        )
    if not (
        np.issubdtype(load.dtype, np.integer) or np.issubdtype(load.dtype, np.floating)
    ):
        raise ValueError(f"`expert_load` must be numeric, got dtype {load.dtype}.")
    load = load.astype(np.float64)
    if not np.all(np.isfinite(load)):
        raise ValueError("`expert_load` must be finite.")
    if np.any(load < 0):
        raise ValueError(
            f"`expert_load` must be >= 0 (pairs per expert), got min {load.min()}."
        )
    return load


def _check_ids(ids: np.ndarray, name: str) -> np.ndarray:
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"`{name}` must be integer expert ids, got {ids.dtype}.")
    num_experts = ids.shape[-1]
    if np.any(np.sort(ids, axis=-1) != np.arange(num_experts)):
        raise ValueError(
            f"`{name}` must be a permutation of 0..{num_experts - 1} along its last "
            "axis (the logical expert at each physical position)."
        )
    return ids.astype(np.int64)


def _replicas(load: np.ndarray, num_shards: int, num_slots: int) -> np.ndarray:
    """Copies of each expert if the `R S` slots held static replicas: DeepSeek EPLB's
    rule, each extra copy to the expert with the most load per copy (at most `R`)."""
    copies = np.ones(load.shape[0], np.int64)
    for _ in range(num_shards * num_slots):
        per_copy = np.where(copies < num_shards, load / copies, -1.0)
        e = int(np.argmax(per_copy))
        if per_copy[e] <= 0:
            break
        copies[e] += 1
    return copies


def _fill(bins, weight, expert, items, cols) -> None:
    """Greedy LPT, in place: each item (heaviest first) to the least-loaded shard with
    an empty position among `cols` and no copy of its expert yet."""
    w = np.append(weight, 0.0)
    load = w[bins].sum(axis=1)
    has = np.zeros((bins.shape[0], expert.max() + 2), bool)
    has[np.arange(bins.shape[0])[:, None], np.append(expert, -1)[bins]] = True
    for it in items[np.argsort(-weight[items], kind="stable")]:
        room = (bins[:, cols] < 0).any(axis=1)
        ok = room & ~has[:, expert[it]]
        r = int(np.argmin(np.where(ok if ok.any() else room, load, np.inf)))
        c = cols[int(np.argmax(bins[r, cols] < 0))]
        bins[r, c] = it
        load[r] += weight[it]
        has[r, expert[it]] = True


def _refine(bins, weight, expert, groups, min_gain: float = 0.0) -> np.ndarray:
    """Best-improvement swaps of two items of the same group (columns) on two shards
    while some swap lowers the sum of squared shard loads (which never raises the
    largest load); never two copies of one expert on a shard. A swap must lower the
    larger of its two shard loads by more than `min_gain`. Each swap strictly lowers
    that sum, so this terminates."""
    bins = bins.copy()
    num_shards = bins.shape[0]
    if num_shards == 1:
        return bins
    w = np.append(weight, 0.0)  # position -1 (empty) weighs 0
    ex = np.append(expert, -1)
    rows = np.arange(num_shards)
    scale = max(float(weight.sum()) ** 2, 1.0)
    for _ in range(4 * bins.size):
        load = w[bins].sum(axis=1)
        count = np.zeros((num_shards, expert.max() + 2), np.int64)
        np.add.at(count, (rows[:, None], ex[bins]), 1)
        best = (-1e-12 * scale, None)
        for cols in groups:
            items = bins[:, cols]
            where = np.repeat(rows, items.shape[1])
            wa, ea = w[items].reshape(-1), ex[items].reshape(-1)
            d = wa[:, None] - wa[None, :]  # a: row item, moves to b's shard
            gap = load[where][:, None] - load[where][None, :]
            gain = 2 * d * (d - gap)
            # The pair's larger load drops by min(d, gap - d).
            bad = (d <= min_gain) | (d >= gap - min_gain)
            bad |= count[where[None, :], ea[:, None]] > 0
            bad |= (count[where[:, None], ea[None, :]] > 0) & (ea[None, :] >= 0)
            gain = np.where(bad, np.inf, gain)
            k = int(np.argmin(gain))
            if gain.flat[k] < best[0]:
                best = (gain.flat[k], (cols, *divmod(k, gain.shape[1])))
        if best[1] is None:
            break
        cols, a, b = best[1]
        per = len(cols)
        (ra, ca), (rb, cb) = divmod(a, per), divmod(b, per)
        ca, cb = cols[ca], cols[cb]
        bins[ra, ca], bins[rb, cb] = bins[rb, cb], bins[ra, ca]
    return bins


def _align(bins: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Physical layout of a partition that moves as few experts as possible: each
    group of experts goes to the shard holding most of them now (greedy matching),
    and experts that stay on their shard keep their slot."""
    num_shards, local = bins.shape
    cur = current.reshape(num_shards, local)
    overlap = (bins[:, :, None, None] == cur[None, None, :, :]).sum(axis=(1, 3))
    shard_of = np.full(num_shards, -1)
    taken = np.zeros(num_shards, bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        b, r = divmod(int(flat), num_shards)
        if shard_of[b] < 0 and not taken[r]:
            shard_of[b], taken[r] = r, True
    out = np.empty_like(cur)
    for b, r in enumerate(shard_of):
        keep = np.isin(cur[r], bins[b])
        out[r] = np.where(keep, cur[r], -1)
        out[r, ~keep] = np.sort(bins[b][~np.isin(bins[b], cur[r])])
    return out.reshape(-1)


def _place_one(
    load: np.ndarray,
    num_shards: int,
    num_slots: int,
    current: np.ndarray,
    tolerance: float,
) -> np.ndarray:
    num_experts = load.shape[0]
    local = num_experts // num_shards
    num_slots = num_slots if num_shards > 1 else 0
    min_gain = tolerance * load.sum() / num_shards
    # Items: every expert's home copy, then the copies its share of the slots would
    # hold (each carrying load / copies); the home copies fill columns [0, L).
    copies = _replicas(load, num_shards, num_slots)
    expert = np.concatenate(
        [np.arange(num_experts), np.repeat(np.arange(num_experts), copies - 1)]
    )
    weight = (load / copies)[expert]
    homes, extra = np.arange(num_experts), np.arange(num_experts, expert.shape[0])
    home_cols, slot_cols = np.arange(local), np.arange(local, local + num_slots)
    groups = [home_cols] + ([slot_cols] if num_slots else [])
    empty = np.full((num_shards, local + num_slots), -1, np.int64)

    from_current = empty.copy()
    from_current[:, :local] = current.reshape(num_shards, local)
    from_scratch = empty.copy()
    _fill(from_scratch, weight, expert, homes, home_cols)
    candidates = []
    for bins in (from_current, from_scratch):
        if num_slots:
            _fill(bins, weight, expert, extra, slot_cols)
        bins = _refine(bins, weight, expert, groups, min_gain)
        ids = _align(bins[:, :local], current)
        shard_load = np.append(weight, 0.0)[bins].sum(axis=1)
        candidates.append((shard_load.max(), np.square(shard_load).sum(), ids))
    # Fewest moved experts among those within the tolerance of the lowest max load,
    # then the lowest sum of squares.
    lowest = min(c[0] for c in candidates)
    return min(
        (c for c in candidates if c[0] <= lowest + min_gain),
        key=lambda c: (np.sum(c[2] != current), c[1]),
    )[2]


def plan_placement(
    expert_load,
    *,
    num_shards: int,
    num_slots: int = 0,
    current=None,
    tolerance: float = 0.01,
) -> Int[np.ndarray, "*batch experts"]:
    """Chooses which logical experts each shard holds, balancing `expert_load`.

    Places `E` experts on `R` shards of exactly `L = E / R` each. With `num_slots = 0`
    the shard loads are balanced as such. With `S > 0` spare slots per shard, the
    placement leaves room for the per-step slot copies: the `R S` slots are first
    shared out as static replicas would be (DeepSeek EPLB's rule: each copy to the
    expert with the most load per copy), every copy carrying `load / copies`, and
    the home and slot copies are packed together, `L + S` per shard. A hot expert
    then shares its home shard with less load, and the shards that would hold its
    copies keep the room the per-step planner fills with them.

    Packing: greedy LPT (heaviest copy first to the least-loaded shard with room and
    no copy of that expert), then best-improvement swaps while they lower the sum of
    squared shard loads (lowering the load of every shard above the others, not only
    the largest). The current placement improved by swaps is a second candidate;
    the one that moves fewer experts wins unless the other's largest load is lower
    by more than `tolerance` (then the lower sum of squares). A swap is made only
    if it lowers the larger of its two shard loads by more than `tolerance`: with a
    stable load, re-placement then moves few experts rather than chasing routing
    noise (measured in `docs/measured.md`). The result is laid out to move as few
    experts as possible (a group of experts goes to the shard that holds most of
    them, and an expert that stays on its shard keeps its slot). Deterministic; runs
    on the host (NumPy) between steps (its time is in `docs/measured.md`).

    **Arguments:**

    - `expert_load`: `[..., E]` non-negative load per logical expert, e.g. the sum of
        `stats.expert_counts` over the last window (NumPy or JAX; leading axes, such as
        the `layers` axis of stacked layers, are placed independently).
    - `num_shards`: `R`, the size of the expert-parallel axis; must divide `E`.
    - `num_slots`: `S`, the layer's spare slots per shard (`config.num_slots`).
    - `current`: `[..., E]` the current `layer.expert_ids` (default: identity).
    - `tolerance`: improvements smaller than this fraction of the mean shard load do
        not move experts (`0` balances as far as swaps go, whatever it moves).

    **Returns:**

    `[..., E]` int32 NumPy array: the new `expert_ids` (logical expert at each
    physical position). `np.sum(new != current)` experts move.
    """
    load = _check_load(expert_load)
    num_experts = load.shape[-1]
    if not isinstance(num_shards, int | np.integer) or isinstance(num_shards, bool):
        raise ValueError(f"`num_shards` must be an integer, got {num_shards!r}.")
    local_experts(num_experts, int(num_shards), shards="shards (`num_shards`)")
    if not isinstance(num_slots, int | np.integer) or num_slots < 0:
        raise ValueError(f"`num_slots` must be an integer >= 0, got {num_slots!r}.")
    if not (isinstance(tolerance, int | float) and 0 <= tolerance < 1):
        raise ValueError(f"`tolerance` must be in [0, 1), got {tolerance!r}.")
    if current is None:
        current = np.broadcast_to(np.arange(num_experts), load.shape)
    current = _check_ids(_to_host(current, "current"), "current")
    if current.shape != load.shape:
        raise ValueError(
            f"`current` has shape {current.shape}, `expert_load` {load.shape}."
        )
    flat_load = load.reshape(-1, num_experts)
    flat_cur = current.reshape(-1, num_experts)
    out = [
        _place_one(lo, int(num_shards), int(num_slots), cu, float(tolerance))
        for lo, cu in zip(flat_load, flat_cur, strict=True)
    ]
    return np.stack(out).reshape(load.shape).astype(np.int32)


# ---------------------------------------------------------------------------------
# Applying a placement to a model and its optimizer state.


def _is_layer(node) -> bool:
    return isinstance(node, MoELayer)


@ft.partial(jax.jit, static_argnames=("sharding",))
def _gather_placed(a, perm, *, sharding):
    index = _index(perm)
    if sharding is None:
        return a[index]
    if has_explicit_axes(sharding.mesh):
        # A gather along an explicitly sharded axis must name its output sharding.
        return a.at[index].get(out_sharding=sharding)
    return jax.lax.with_sharding_constraint(a[index], sharding)


def _index(perm):
    """`a[_index(perm)][..., p, ...] == a[..., perm[..., p], ...]` for `a` of shape
    `perm.shape + rest` (leading axes of `perm`: stacked layers)."""
    xp = np if isinstance(perm, np.ndarray) else jnp
    batch = perm.shape[:-1]
    grids = tuple(
        xp.arange(n).reshape((n,) + (1,) * (len(batch) - i))
        for i, n in enumerate(batch)
    )
    return grids + (perm,)


def _permute_leaf(a, perm, where: str):
    if not eqx.is_array(a):
        return a  # None, or an optimizer's placeholder for a masked leaf
    axis = perm.ndim - 1
    if a.shape[: axis + 1] != perm.shape:
        raise ValueError(
            f"{where}: leaf of shape {a.shape} does not start with the permutation's "
            f"shape {perm.shape} ([..., experts])."
        )
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
        # The placed result keeps the input's sharding (experts split over the mesh).
        sharding = a.sharding
        sharding = (
            sharding if isinstance(sharding, jax.sharding.NamedSharding) else None
        )
        axis_name = _split_axis(sharding, a.ndim, axis)
        if axis_name is not None and isinstance(perm, np.ndarray):
            return _move_sharded(a, perm, sharding, axis_name)
        return _gather_placed(a, jnp.asarray(perm), sharding=sharding)
    if isinstance(a, np.ndarray) and isinstance(perm, np.ndarray):
        return a[_index(perm)]
    return a[_index(jnp.asarray(perm))]


def _split_axis(sharding, ndim: int, axis: int) -> str | None:
    """The mesh axis that splits `axis` (the experts), if nothing else is split."""
    if sharding is None:
        return None
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    entry = spec[axis]
    if isinstance(entry, tuple):
        entry = entry[0] if len(entry) == 1 else None
    others = spec[:axis] + spec[axis + 1 :]
    if not isinstance(entry, str) or any(e is not None for e in others):
        return None
    return entry


def _move_tables(perm: np.ndarray, num_shards: int):
    """Per shift `d` of a cyclic exchange: `(d, send [R, M, 2], recv [R, M, 2])`, the
    (row, local slot) each shard sends to shard `r + d`, and where shard `r` puts what
    it receives from `r - d`; `M` is the most one shard sends at that shift, padding
    points past the local slots (dropped on write)."""
    rows = perm.reshape(-1, perm.shape[-1])
    local = rows.shape[1] // num_shards
    dest = np.arange(rows.shape[1])
    moves = [[[] for _ in range(num_shards)] for _ in range(num_shards)]
    for b, row in enumerate(rows):
        for p, q in zip(dest, row, strict=True):
            s, r = q // local, p // local
            moves[(r - s) % num_shards][s].append((b, q % local, p % local))
    tables = []
    for d, by_source in enumerate(moves):
        width = max(len(m) for m in by_source)
        if width == 0:
            continue
        send = np.zeros((num_shards, width, 2), np.int32)
        recv = np.zeros((num_shards, width, 2), np.int32)
        recv[..., 1] = local  # padding: out of range, dropped
        for s, items in enumerate(by_source):
            r = (s + d) % num_shards
            for i, (b, src, dst) in enumerate(items):
                send[s, i] = (b, src)
                recv[r, i] = (b, dst)
        tables.append((d, send, recv))
    return tables


def _move_sharded(a, perm: np.ndarray, sharding, axis_name: str):
    """`a[_index(perm)]` for experts split over `axis_name`, moving only the experts
    that change shard, by cyclic shifts (`ppermute`): a device holds its shard, the
    result and what it receives (at most its shard again). A gather along the split
    axis instead materialises every expert on every device."""
    mesh = sharding.mesh
    num_shards = mesh.shape[axis_name]
    batch = perm.shape[:-1]
    tables = _move_tables(perm, num_shards)

    def body(x):
        shard = jax.lax.axis_index(axis_name)
        flat = x.reshape((-1,) + x.shape[len(batch) :])  # [rows, L, ...]
        out = flat
        for d, send, recv in tables:
            src = jnp.asarray(send)[shard]
            dst = jnp.asarray(recv)[shard]
            buf = flat[src[:, 0], src[:, 1]]
            if d:
                pairs = [(i, (i + d) % num_shards) for i in range(num_shards)]
                buf = jax.lax.ppermute(buf, axis_name, pairs)
            out = out.at[dst[:, 0], dst[:, 1]].set(buf, mode="drop")
        return out.reshape(x.shape)

    spec = sharding.spec
    moved = jax.shard_map(
        body, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False
    )
    return jax.jit(moved, out_shardings=sharding)(a)


def _permute_layer(node, perm, where: str):
    def fix(a):
        return _permute_leaf(a, perm, where)

    experts = jax.tree.map(fix, node.experts)
    ids = fix(node.expert_ids)
    return eqx.tree_at(
        lambda l: (l.experts, l.expert_ids),
        node,
        (experts, ids),
        is_leaf=lambda x: x is None,
    )


def permute_experts(tree: PyTree, perm) -> PyTree:
    """Applies one permutation of physical expert positions to every
    [`moe_eqx.MoELayer`][] node of `tree`: its expert weights and its `expert_ids`.

    Use it for a model and equally for its optimizer state: optax's moments (e.g.
    `optax.adam`'s `mu` and `nu`) hold `MoELayer` nodes of the model's structure, whose
    expert moments must move with the experts. The router (and its selection bias)
    keeps logical ids and is not touched. Jit-able (a gather). Outside `jit` each
    placed array keeps its sharding, and with a concrete `perm` experts split over
    one mesh axis move by cyclic shifts between shards (`ppermute`), only those that
    change shard, with at most about three shards' worth of expert memory per device
    at EP8 (a gather along the split axis would materialise every expert on every
    device: 8 shards' worth).

    **Arguments:**

    - `tree`: any PyTree containing `MoELayer` nodes (a model, an optimizer state).
    - `perm`: `[..., E]` integers: new physical position `p` takes what old position
        `perm[..., p]` held (leading axes: stacked layers). Applied to every node.

    **Returns:**

    `tree` with every `MoELayer` node permuted (`new.expert_ids[p] ==
    old.expert_ids[perm[p]]`).
    """
    if isinstance(perm, jax.core.Tracer):
        index = perm
    else:
        index = _check_ids(_to_host(perm, "perm"), "perm")
    return jax.tree.map(
        lambda n: _permute_layer(n, index, "permute_experts") if _is_layer(n) else n,
        tree,
        is_leaf=_is_layer,
    )


def _layer_paths(tree) -> list:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_layer)[0]
    return [(path, node) for path, node in flat if _is_layer(node)]


def _plan_perms(model, expert_load, num_shards: int, num_slots) -> dict:
    """`{path: perm}` for every `MoELayer` node of `model`, from its load."""
    layers = _layer_paths(model)
    if not layers:
        raise ValueError("`model` contains no `MoELayer` to re-place.")
    if isinstance(expert_load, list | tuple):
        loads = list(expert_load)
    else:
        loads = [expert_load]
    if len(loads) != len(layers):
        raise ValueError(
            f"`expert_load` must be one array per `MoELayer` of `model` (found "
            f"{len(layers)}, in tree-flatten order), got {len(loads)}."
        )
    perms = {}
    for (path, node), load in zip(layers, loads, strict=True):
        current = _check_ids(
            _to_host(node.expert_ids, "layer.expert_ids"), "expert_ids"
        )
        load = _check_load(load, node.config.num_experts)
        if load.shape != current.shape:
            raise ValueError(
                f"`expert_load` for layer {jax.tree_util.keystr(path) or '(root)'} has "
                f"shape {load.shape}, its `expert_ids` {current.shape}."
            )
        slots = node.config.num_slots if num_slots is None else num_slots
        new = plan_placement(
            load, num_shards=num_shards, num_slots=slots, current=current
        )
        position = np.argsort(current, axis=-1)  # old position of each logical expert
        perms[path] = np.take_along_axis(position, new.astype(np.int64), axis=-1)
    return perms


def _apply_perms(tree, perms: dict):
    """Permutes every `MoELayer` node of `tree` by the perm of the model layer whose
    path is the longest suffix of the node's path (optimizer states nest the model's
    structure under their own keys, e.g. `[0].mu.blocks.moe`)."""

    def match(path):
        best = None
        for model_path in perms:
            n = len(model_path)
            if n <= len(path) and tuple(path[len(path) - n :]) == tuple(model_path):
                if best is None or n > len(best):
                    best = model_path
        return best

    def fix(path, node):
        if not _is_layer(node):
            return node
        key = match(path)
        if key is None:
            raise ValueError(
                f"`MoELayer` at {jax.tree_util.keystr(path)} matches no layer of the "
                "model (an optimizer state must mirror the model's structure)."
            )
        return _permute_layer(node, perms[key], jax.tree_util.keystr(path))

    return jax.tree_util.tree_map_with_path(fix, tree, is_leaf=_is_layer)


def rebalance_experts(
    model: PyTree, expert_load, *, num_shards: int, num_slots: int | None = None
) -> PyTree:
    """Re-places experts on their home shards to balance `expert_load`.

    Plans with [`moe_eqx.internal.plan_placement`][] from the layer's current `expert_ids` and
    moves the expert weights accordingly; the layer computes the same function
    before and after (the router keeps logical ids). Runs between steps (outside
    `jit`); placed arrays keep their sharding. For the optimizer state as well, use
    [`moe_eqx.rebalance`][].

    **Arguments:**

    - `model`: a [`moe_eqx.MoELayer`][], or any PyTree containing them (a model;
        stacked layers with leading axes are fine).
    - `expert_load`: `[..., E]` load per logical expert for the (single) layer, e.g.
        the sum of `stats.expert_counts` over a window; for several layers a list,
        one per layer in tree-flatten order.
    - `num_shards`: `R`, the size of the expert-parallel mesh axis.
    - `num_slots`: spare slots per shard to leave room for (default: each layer's
        `config.num_slots`).

    **Returns:**

    `model` with its experts re-placed and `expert_ids` updated.
    """
    perms = _plan_perms(model, expert_load, num_shards, num_slots)
    return _apply_perms(model, perms)


def rebalance(
    model: PyTree,
    opt_state: PyTree,
    expert_load,
    *,
    num_shards: int,
    num_slots: int | None = None,
) -> tuple[PyTree, PyTree]:
    """[`moe_eqx.rebalance_experts`][] for a model and its optimizer state together.

    The optimizer's per-expert state (e.g. Adam's moments of the expert weights) is
    permuted exactly as the weights, so training continues as if nothing moved: one
    step after re-placement equals re-placement after the step. The router's bias
    and its state are logical and stay as they are.

    ```python
    if step % every == 0:
        model, opt_state = me.rebalance(model, opt_state, load, num_shards=R)
    ```

    **Arguments:**

    - `model`: a PyTree containing [`moe_eqx.MoELayer`][]s.
    - `opt_state`: its optimizer state (any PyTree; its `MoELayer` nodes are matched
        to the model's by path), or `None`.
    - `expert_load`, `num_shards`, `num_slots`: as for
        [`moe_eqx.rebalance_experts`][].

    **Returns:**

    `(model, opt_state)`, re-placed.
    """
    perms = _plan_perms(model, expert_load, num_shards, num_slots)
    return _apply_perms(model, perms), _apply_perms(opt_state, perms)
