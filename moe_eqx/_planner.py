"""Dynamic duplication of hot experts into spare slots, and token diversion.

Every step, from the all-gathered `[R, E]` routing counts, `plan_duplication` chooses
which experts fill each shard's `S` spare slots and how many of each expert's pairs each
replica processes (its quota). `assign_destinations` then sends every pair of a shard to
a physical destination (shard, local group) so that each replica receives exactly its
quota. Both are pure, jit-able, deterministic integer computations with static shapes,
identical on every shard because their input is.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._rules import local_experts

__all__ = [
    "DuplicationPlan",
    "assign_destinations",
    "plan_duplication",
    "slot_pair_counts",
]


class DuplicationPlan(eqx.Module):
    """Which experts fill the spare slots, and how pairs are split among replicas.

    Expert `e` has its home copy on shard `e // L` (local group `e % L`) and possibly
    slot copies elsewhere.

    **Fields:**

    - `slot_expert`: `[R, S]` int32, the expert held by slot `s` of shard `r`, `-1` if
        the slot is empty. A shard holds at most one copy of an expert and never its
        own home experts; empty slots come last.
    - `expert_shard_pairs`: `[E, R]` int32, how many pairs of expert `e` shard `r`
        processes. Non-zero only where a copy of `e` lives; row `e` sums to the number
        of pairs routed to `e`.
    """

    slot_expert: Int[Array, "shards slots"]
    expert_shard_pairs: Int[Array, "experts shards"]

    @property
    def shard_load(self) -> Int[Array, " shards"]:
        """`[R]` pairs each shard processes (home experts and slots)."""
        return self.expert_shard_pairs.sum(axis=0)


# Candidate levels of the coarse search, as fractions of the mean load above the mean.
# Dense near the mean, where a plan with S >= 2 usually lands; the refinement then
# searches linearly inside the bracket that the coarse search found.
# fmt: off
_COARSE_STEPS = (
    0.0, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.045, 0.065, 0.09,
    0.125, 0.175, 0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 3.0, 5.0, 8.0,
)
# fmt: on
_FINE_LEVELS = 16


def _piece_ends(
    levels: Int[Array, " levels"],
    threshold: Int[Array, " pieces"],
    pairs: Int[Array, " pieces"],
    num_slots: int,
) -> Int[Array, "levels pieces_padded"]:
    """End of each piece on the line of every candidate level, padded by `S` copies of
    the line's total so that looking `S` pieces past the last one is harmless."""
    zero = jnp.zeros((), jnp.int32)
    sizes = jnp.minimum(
        jnp.maximum(threshold[None, :] - levels[:, None], zero), pairs[None, :]
    )
    ends = jnp.cumsum(sizes, axis=1)
    pad = jnp.broadcast_to(ends[:, -1:], (levels.shape[0], num_slots))
    return jnp.concatenate([ends, pad], axis=1)


def _wrap_around(
    piece_end: Int[Array, "levels pieces_padded"],
    deficit: Int[Array, "shards levels"],
    num_slots: int,
    *,
    record: bool,
):
    """McNaughton's wrap-around fill of the line by the receivers, at every level.

    Receivers (by increasing load) take consecutive intervals of the line, so an
    expert's piece lands on consecutive receivers, once on each. A receiver takes its
    deficit but stops at the end of its `S`-th piece, so that no shard needs more than
    `S` slots; the rest goes on to the next receiver. A level is feasible if the
    receivers consume the whole line.

    Returns `done [levels]`, and with `record` also the start of each receiver's
    interval and the index of its first piece (`[shards, levels]` each).
    """
    window = jnp.arange(num_slots, dtype=jnp.int32)[None, :]

    def step(carry, deficit_j):
        start, first = carry
        # Once the line is consumed `first` keeps advancing past the padding: clip,
        # so the read sees the line's total (the padding's value), never a fill value.
        ends = jnp.take_along_axis(
            piece_end, first[:, None] + window, axis=1, mode="clip"
        )
        stop = jnp.minimum(start + deficit_j, ends[:, -1])
        passed = (ends <= stop[:, None]).sum(axis=1, dtype=jnp.int32)
        return (stop, first + passed), ((start, first) if record else None)

    # zeros_like keeps the varying-manual-axes type of the input inside shard_map.
    zeros = jnp.zeros_like(piece_end[:, 0])
    # Without per-step outputs this loop costs next to nothing on CPU; the outputs
    # (dynamic-update-slices) dominate, so the coarse search does not record them.
    (end, _), history = jax.lax.scan(step, (zeros, zeros), deficit)
    done = end >= piece_end[:, -1]
    return (done, history) if record else done


def plan_duplication(
    counts: Int[Array, "shards experts"], *, num_slots: int
) -> DuplicationPlan:
    """Chooses the experts of every spare slot and each replica's quota of pairs.

    Balances the pairs processed per shard. At a level `c`, every shard above `c`
    sheds its excess `load - c`, hottest home expert first (the fewest pieces); the
    pieces are laid end to end on a line and the shards below `c` (by increasing load)
    take consecutive intervals of it as slot copies (McNaughton's wrap-around rule),
    each up to its deficit `c - load` and at most `S` pieces. The level is the lowest
    feasible one found by a vectorised two-stage search (a coarse grid from the mean
    load up, then a linear refinement), so every shard ends at or below it.

    The result is exact in integers (quotas sum to each expert's pairs),
    deterministic, and has static shapes, so it can run inside `jit`/`shard_map` on
    every shard. Slot copies of a shard are listed hottest source first.

    **Arguments:**

    - `counts`: `[R, E]` integer pairs routed by each source shard to each expert
        (all-gathered, so identical on every shard). `E` must be a multiple of `R`;
        the total must stay below `2**30` (int32 arithmetic).
    - `num_slots`: `S`, spare slots per shard (static). `0` gives the home-only plan.

    **Returns:**

    A `DuplicationPlan`; `plan.shard_load` is the resulting load per shard.

    Cost: two `lax.scan`s of `R` tiny steps (each vectorised over the candidate
    levels), a few sorts of `E` or `R` integers and `O(E R)` element-wise work. On CPU
    at `R=64, E=256` this is a few hundred microseconds.
    """
    num_shards, num_experts = counts.shape
    local = local_experts(num_experts, num_shards)
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
        raise ValueError(f"`num_slots` must be an integer >= 0, got {num_slots!r}.")
    with jax.named_scope("moe_eqx.planner"):
        counts = counts.astype(jnp.int32)
        pairs = counts.sum(axis=0)
        zero = jnp.zeros((), jnp.int32)
        experts = jnp.arange(num_experts, dtype=jnp.int32)
        home = experts // local
        is_home = home[:, None] == jnp.arange(num_shards, dtype=jnp.int32)[None, :]
        # Each slot holds a different foreign expert: at most E - L can be useful.
        usable = min(num_slots, num_experts - local)
        if usable == 0:
            return DuplicationPlan(
                slot_expert=jnp.full((num_shards, num_slots), -1, jnp.int32),
                expert_shard_pairs=jnp.where(is_home, pairs[:, None], zero),
            )

        by_shard = pairs.reshape(num_shards, local)
        load = by_shard.sum(axis=1)
        # Pairs of the hotter experts of the same shard (ties: lower id is hotter).
        if local <= 64:
            # Pairwise comparisons fuse into one cheap op; a sort costs more on CPU.
            ids = experts.reshape(num_shards, local)
            hotter = (by_shard[:, None, :] > by_shard[:, :, None]) | (
                (by_shard[:, None, :] == by_shard[:, :, None])
                & (ids[:, None, :] < ids[:, :, None])
            )
            before = jnp.where(hotter, by_shard[:, None, :], zero).sum(axis=2)
        else:
            order = jnp.argsort(-by_shard, axis=1, stable=True)
            hot_first = jnp.take_along_axis(by_shard, order, axis=1)
            rows = jnp.arange(num_shards)[:, None]
            before = (
                jnp.zeros_like(by_shard)
                .at[rows, order]
                .set(jnp.cumsum(hot_first, axis=1) - hot_first)
            )
        # At level c, expert e sheds min(max(threshold_e - c, 0), pairs_e). Ordering
        # the pieces by decreasing threshold keeps the non-empty ones a prefix of the
        # line at every level (no compaction), sources by decreasing load and each
        # source's hottest experts first.
        threshold = (load[:, None] - before).reshape(num_experts)
        threshold = jnp.where(pairs > 0, threshold, -1)
        piece_order = jnp.argsort(-threshold, stable=True).astype(jnp.int32)
        piece_threshold = threshold[piece_order]
        piece_pairs = pairs[piece_order]
        recv_order = jnp.argsort(load, stable=True).astype(jnp.int32)
        recv_load = load[recv_order]

        def feasible(levels, *, record=False):
            ends = _piece_ends(levels, piece_threshold, piece_pairs, usable)
            deficit = jnp.maximum(levels[None, :] - recv_load[:, None], zero)
            return ends, _wrap_around(ends, deficit, usable, record=record)

        lowest = (load.sum() + num_shards - 1) // num_shards
        highest = load.max()
        mean = load.astype(jnp.float32).mean()
        steps = jnp.asarray(_COARSE_STEPS, jnp.float32)
        # Clip in float32 before the cast so that no step overflows int32.
        room = jnp.maximum(highest - lowest, zero).astype(jnp.float32)
        coarse = jnp.minimum(
            lowest + jnp.minimum(steps * mean, room).astype(jnp.int32), highest
        )
        # The home-only level is always feasible (nothing to shed).
        coarse = jnp.concatenate([coarse, highest[None]])
        found = jnp.argmax(feasible(coarse)[1])
        top = coarse[found]
        bottom = jnp.where(found > 0, coarse[jnp.maximum(found - 1, 0)] + 1, top)
        fractions = jnp.arange(1, _FINE_LEVELS + 1, dtype=jnp.float32) / _FINE_LEVELS
        span = (top - bottom).astype(jnp.float32)
        fine = jnp.minimum(bottom + (fractions * span).astype(jnp.int32), top)
        fine = jnp.concatenate([bottom[None], fine])
        fine_end, (fine_done, (fine_lo, fine_first)) = feasible(fine, record=True)
        # `fine` ends at a feasible level, so some level is always done; should none
        # be, the home-only plan (always valid) is used, never an arbitrary level.
        any_done = jnp.any(fine_done)
        pick = jnp.argmax(fine_done)
        best = jnp.where(any_done, fine[pick], highest)
        piece_end, lo, first = fine_end[pick], fine_lo[:, pick], fine_first[:, pick]
        hi = jnp.concatenate([lo[1:], piece_end[-1:]])
        piece_start = jnp.concatenate([zero[None], piece_end[:-1]])
        piece_expert = jnp.concatenate(
            [piece_order, jnp.full((usable,), -1, jnp.int32)]
        )
        index = jnp.minimum(
            first[:, None] + jnp.arange(usable, dtype=jnp.int32)[None, :],
            piece_end.shape[0] - 1,
        )
        amount = jnp.maximum(
            jnp.minimum(piece_end[index], hi[:, None])
            - jnp.maximum(piece_start[index], lo[:, None]),
            zero,
        )
        amount = jnp.where(any_done, amount, zero)
        recv_slots = jnp.where(amount > 0, piece_expert[index], -1)
        slot_expert = jnp.full((num_shards, num_slots), -1, jnp.int32)
        slot_expert = slot_expert.at[recv_order, :usable].set(recv_slots)

        shed = jnp.minimum(jnp.maximum(threshold - best, zero), pairs)
        q = jnp.where(is_home, (pairs - shed)[:, None], zero)
        q = q.at[
            jnp.where(recv_slots >= 0, recv_slots, num_experts),
            jnp.broadcast_to(recv_order[:, None], recv_slots.shape),
        ].add(amount, mode="drop")
        return DuplicationPlan(slot_expert=slot_expert, expert_shard_pairs=q)


def slot_pair_counts(
    plan: DuplicationPlan, *, num_local_experts: int
) -> Int[Array, "shards groups"]:
    """Pairs each shard processes per local group: `L` home experts, then `S` slots.

    These are the group sizes of each shard's grouped matmul.

    **Arguments:**

    - `plan`: the `DuplicationPlan`.
    - `num_local_experts`: `L = E / R`.

    **Returns:**

    `[R, L + S]` int32; row `r` sums to `plan.shard_load[r]`. Empty slots count 0.
    """
    q = plan.expert_shard_pairs
    num_experts, num_shards = q.shape
    if num_local_experts * num_shards != num_experts:
        raise ValueError(
            f"`num_local_experts` ({num_local_experts}) times the number of shards "
            f"({num_shards}) must equal the number of experts ({num_experts})."
        )
    with jax.named_scope("moe_eqx.slot_pair_counts"):
        shards = jnp.arange(num_shards)
        home_counts = q.reshape(num_shards, num_local_experts, num_shards)[
            shards, :, shards
        ]
        se = plan.slot_expert
        slot_counts = jnp.where(
            se >= 0, q[jnp.maximum(se, 0), shards[:, None]], jnp.zeros((), q.dtype)
        )
        return jnp.concatenate([home_counts, slot_counts], axis=1)


def assign_destinations(
    plan: DuplicationPlan,
    counts: Int[Array, "shards experts"],
    experts: Int[Array, "tokens k"],
    shard_index: Int[Array, ""] | int,
    *,
    num_local_experts: int,
) -> tuple[Int[Array, "tokens k"], Int[Array, "tokens k"]]:
    """Maps each of this shard's pairs to the replica that processes it.

    The pairs of expert `e` are put in one global order: all of source shard 0's pairs,
    then shard 1's, ...; within a shard in row-major `(token, j)` order. The replicas
    of `e`, in shard order, take consecutive ranges of that order of lengths
    `plan.expert_shard_pairs[e]`. So, over all source shards, replica `d` of `e`
    receives exactly `plan.expert_shard_pairs[e, d]` pairs. Sort-based: memory is
    `O(T k)`, and each pair's range is found by a binary search over the `R` shards.

    **Arguments:**

    - `plan`: the `DuplicationPlan` made from `counts`.
    - `counts`: `[R, E]` the all-gathered counts; row `shard_index` must be the
        histogram of `experts`.
    - `experts`: `[T, k]` this shard's routed experts, in `[0, E)`.
    - `shard_index`: this shard's index (e.g. `lax.axis_index(axis_name)`).
    - `num_local_experts`: `L = E / R`.

    **Returns:**

    `(dest_shard, dest_group)`, both `[T, k]` int32: the destination shard, and the
    local group there: `e % L` on the home shard `e // L`, else `L + s` where
    `plan.slot_expert[dest_shard, s] == e`. Both are `-1` for a pair that the plan
    gives no replica (its quotas sum to fewer pairs than were routed, or name a
    shard without a copy): a plan made by [`moe_eqx.plan_duplication`][] from the
    same `counts` never does, and the layer reports such pairs as lost.
    """
    num_shards, num_experts = counts.shape
    if num_local_experts * num_shards != num_experts:
        raise ValueError(
            f"`num_local_experts` ({num_local_experts}) times the number of shards "
            f"({num_shards}) must equal the number of experts ({num_experts})."
        )
    num_slots = plan.slot_expert.shape[1]
    with jax.named_scope("moe_eqx.assign_destinations"):
        experts = experts.astype(jnp.int32)
        home_shard = experts // num_local_experts
        home_group = experts % num_local_experts
        if num_slots == 0 or num_shards == 1:
            return home_shard, home_group
        shard_index = jnp.asarray(shard_index, jnp.int32)
        counts = counts.astype(jnp.int32)
        flat = experts.reshape(-1)
        num_pairs = flat.shape[0]

        # Rank of each pair among this shard's pairs of the same expert, from one
        # sort by (expert, position).
        index = jnp.arange(num_pairs, dtype=jnp.int32)
        if num_experts * num_pairs < 2**31:
            # A single int32 key sorts ~5x faster than a stable argsort on CPU.
            key = jnp.sort(flat * num_pairs + index)
            perm, sorted_experts = key % num_pairs, key // num_pairs
        else:
            perm = jnp.argsort(flat, stable=True).astype(jnp.int32)
            sorted_experts = flat[perm]
        local_counts = counts[shard_index]
        start = jnp.cumsum(local_counts) - local_counts
        rank_sorted = index - start[sorted_experts]
        rank = (
            jnp.zeros((num_pairs,), jnp.int32)
            .at[perm]
            .set(rank_sorted, unique_indices=True)
        )
        offset = (jnp.cumsum(counts, axis=0) - counts)[shard_index]
        position = offset[flat] + rank

        # First shard d with cumulative quota[e, :d+1] > position (binary search).
        cum = jnp.cumsum(plan.expert_shard_pairs.astype(jnp.int32), axis=1).reshape(-1)
        base = flat * num_shards
        lo = jnp.zeros_like(flat)
        hi = jnp.full_like(flat, num_shards - 1)
        for _ in range((num_shards - 1).bit_length()):
            mid = (lo + hi) // 2
            above = cum[base + mid] > position
            lo = jnp.where(above, lo, mid + 1)
            hi = jnp.where(above, mid, hi)
        dest = lo

        slot_match = plan.slot_expert[dest] == flat[:, None]
        slot = jnp.argmax(slot_match, axis=1).astype(jnp.int32)
        at_home = dest == home_shard.reshape(-1)
        group = jnp.where(at_home, home_group.reshape(-1), num_local_experts + slot)
        # A pair past its expert's quotas, or sent where no copy of its expert lives,
        # has no destination: it is marked -1 (never sent), and the layer counts it
        # in `stats.lost_pairs`, rather than computing it with the wrong expert.
        has_quota = position < cum[base + num_shards - 1]
        has_copy = at_home | jnp.any(slot_match, axis=1)
        ok = has_quota & has_copy
        dest = jnp.where(ok, dest, -1)
        group = jnp.where(ok, group, -1)
        return dest.reshape(experts.shape), group.reshape(experts.shape)
