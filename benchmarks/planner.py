"""Benchmark of the dynamic-duplication planner.

Measures, on synthetic routing (`moe_eqx.workloads`):

1. Balance: rank load max/mean with home placement only ("before") and after
   `plan_duplication` ("after"), for R in {8, 16, 32, 64}, Zipf s in {0.8, 1.0, 1.2},
   hot experts "spread" (round-robin over shards), "contiguous" (hottest = experts
   0, 1, ...) or "random", S in {1, 2, 4} spare slots per shard; slot
   copies used per shard and sent by the busiest home shard; the planner's jitted
   time (median after warm-up) on this machine's CPU; and `assign_destinations`
   time for one shard.
   Goals (E=256, k=8, 1024 tokens per shard, Zipf(1.2)): max/mean <= 1.001 at EP32
   and EP64 with S=1 when hot experts are spread and S=2 when they are contiguous,
   at the default out-degree bound, with a pass/fail column.
   Out-degree: max/mean against the bound `max_exports` C (slot copies of one home
   shard's experts) at C = 1, 2, S, 2S, the default and unbounded, EP8/32/64.
2. Backward communication of the slot-expert gradients at DeepSeek-like sizes
   (d_model 7168, d_ff 2048, bf16): the all-gather of `[R, S, ...]` slot gradients and
   their indices (the design), a targeted send of each slot gradient to its home shard
   only, and the naive psum of a global `[E, ...]` gradient.
3. Per-step planning (at the default out-degree bound, and unbounded) vs a periodic
   static placement (replicas chosen from the experts hot in the previous window of
   W steps and kept for the next W steps), on a rotating hotspot and a drifting Zipf
   workload. The static placement is scored twice: with
   the window's split fractions (as static redundancy does) and with the best possible
   per-step split over its stale replicas (a linear program): even that loses.
4. Compile time: XLA seconds to compile `plan_duplication` alone and with
   `assign_destinations` (min over fresh compiles, run round-robin), at R=8, E=16,
   S=1 (T=256, k=2), R=8, E=32, S=2 (T=256, k=4) and R=64, E=256, S=2 (T=1024,
   k=8), with the number of kernels (fusions) XLA emits.

Every ratio is measured against a baseline computed in the same process.

    python3 benchmarks/planner.py            # full run, a few minutes on 2 CPU cores
    python3 benchmarks/planner.py --quick    # seconds; used by the smoke test

Writes `benchmarks/results/planner.json` (or `--out`).
"""

import argparse
import functools
import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import jitted_plan, max_over_mean
from scipy.optimize import linprog

import moe_eqx.workloads as wl
from moe_eqx._planner import (
    _plan,
    assign_destinations,
    default_max_exports,
    plan_duplication,
)

NUM_EXPERTS = 256
TOP_K = 8
D_MODEL = 7168
D_FF = 2048
BYTES_BF16 = 2
BYTES_INDEX = 4


GOAL = 1.001
# (R, E, S, T, k) of the compile-time rows.
COMPILE_SHAPES = [(8, 16, 1, 256, 2), (8, 32, 2, 256, 4), (64, 256, 2, 1024, 8)]


@functools.cache
def _jitted_bounded(num_slots: int):
    # The bound is traced: one compilation per shape serves every bound.
    return jax.jit(functools.partial(_plan, num_slots=num_slots))


def _exports_max(plan, local: int) -> int:
    """Slot copies of the experts of the busiest home shard (its out-degree)."""
    slots = np.asarray(plan.slot_expert)
    homes = slots[slots >= 0] // local
    return int(np.bincount(homes, minlength=slots.shape[0]).max()) if homes.size else 0


def _zipf_counts(num_shards: int, tokens: int, s: float, hot: str, seed: int):
    choices = wl.sample_workload(
        "zipf",
        num_shards=num_shards,
        tokens=tokens,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        s=s,
        hot=hot,
        seed=seed,
    )
    return wl.counts_from_choices(choices, NUM_EXPERTS)


def _time(fn, *args, reps: int) -> dict:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    times = np.asarray(times) * 1e6
    return {"median_us": float(np.median(times)), "min_us": float(times.min())}


def _home_load(counts: np.ndarray) -> np.ndarray:
    num_shards = counts.shape[0]
    return counts.sum(axis=0).reshape(num_shards, -1).sum(axis=1)


def balance(args) -> list[dict]:
    rows = []
    for num_shards in args.shards:
        for hot in args.hot:
            for s in args.zipf:
                choices = wl.sample_workload(
                    "zipf",
                    num_shards=num_shards,
                    tokens=args.tokens,
                    num_experts=NUM_EXPERTS,
                    top_k=TOP_K,
                    s=s,
                    hot=hot,
                    seed=args.seed,
                )
                counts = wl.counts_from_choices(choices, NUM_EXPERTS)
                before = max_over_mean(_home_load(counts))
                for num_slots in args.slots:
                    fn = jitted_plan(num_slots)
                    counts_j = jnp.asarray(counts)
                    timing = _time(fn, counts_j, reps=args.reps)
                    plan = fn(counts_j)
                    used = (np.asarray(plan.slot_expert) >= 0).sum(axis=1)
                    sent = _exports_max(plan, NUM_EXPERTS // num_shards)
                    rows.append(
                        dict(
                            shards=num_shards,
                            hot=hot,
                            zipf_s=s,
                            slots=num_slots,
                            before=before,
                            after=max_over_mean(plan.shard_load),
                            copies_mean=float(used.mean()),
                            copies_max=int(used.max()),
                            exports_max=sent,
                            plan_median_us=timing["median_us"],
                            plan_min_us=timing["min_us"],
                        )
                    )
                    print(
                        f"R={num_shards:3d} {hot:10s} s={s:.1f} S={num_slots}  "
                        f"max/mean {before:7.3f} -> {rows[-1]['after']:.4f}  "
                        f"copies/shard {used.mean():.2f} (max {used.max()})  "
                        f"sent by a home <= {sent:2d}  "
                        f"plan {timing['median_us']:7.0f} us",
                        flush=True,
                    )
    return rows


def goals(args) -> list[dict]:
    """The balance goals, at the default bound, against home-only in the same run."""
    rows = []
    for num_shards in args.goal_shards:
        for hot, num_slots in (("spread", 1), ("contiguous", 2)):
            counts = jnp.asarray(
                _zipf_counts(num_shards, args.goal_tokens, 1.2, hot, args.seed)
            )
            fn = jitted_plan(num_slots)
            timing = _time(fn, counts, reps=args.reps)
            plan = fn(counts)
            after = max_over_mean(plan.shard_load)
            local = NUM_EXPERTS // num_shards
            rows.append(
                dict(
                    shards=num_shards,
                    hot=hot,
                    slots=num_slots,
                    tokens_per_shard=args.goal_tokens,
                    before=max_over_mean(_home_load(np.asarray(counts))),
                    after=after,
                    goal=GOAL,
                    passed=after <= GOAL,
                    exports_max=_exports_max(plan, local),
                    max_exports=default_max_exports(num_shards, local, num_slots),
                    plan_median_us=timing["median_us"],
                )
            )
    print(
        f"{'EP':>3} {'hot':>10} {'S':>2} {'before':>7} {'after':>7} {'goal':>6} "
        f"{'pass':>5} {'sent':>5} {'C':>3} {'plan us':>8}"
    )
    for row in rows:
        print(
            f"{row['shards']:3d} {row['hot']:>10} {row['slots']:2d} "
            f"{row['before']:7.3f} {row['after']:7.4f} {row['goal']:6.3f} "
            f"{'PASS' if row['passed'] else 'FAIL':>5} {row['exports_max']:5d} "
            f"{row['max_exports']:3d} {row['plan_median_us']:8.0f}",
            flush=True,
        )
    return rows


def out_degree(args) -> list[dict]:
    """Balance against the out-degree bound C (slot copies of one home shard)."""
    rows = []
    for num_shards in args.degree_shards:
        for hot, num_slots in (("spread", 1), ("contiguous", 2)):
            counts = jnp.asarray(
                _zipf_counts(num_shards, args.goal_tokens, 1.2, hot, args.seed)
            )
            local = NUM_EXPERTS // num_shards
            unbounded = num_shards * num_slots  # no home shard can send more
            bounds = {
                "1": 1,
                "2": 2,
                "S": num_slots,
                "2S": 2 * num_slots,
                "default": default_max_exports(num_shards, local, num_slots),
                "unbounded": unbounded,
            }
            row = dict(shards=num_shards, hot=hot, slots=num_slots)
            for name, bound in bounds.items():
                bound = min(bound, unbounded)
                plan = _jitted_bounded(num_slots)(counts, max_exports=jnp.int32(bound))
                row[f"C={name}"] = dict(
                    bound=bound,
                    after=max_over_mean(plan.shard_load),
                    exports_max=_exports_max(plan, local),
                )
            rows.append(row)
    names = ["1", "2", "S", "2S", "default", "unbounded"]
    print(
        f"{'EP':>3} {'hot':>10} {'S':>2} "
        + " ".join(f"{'C=' + n:>14}" for n in names)
        + "   (max/mean, copies sent by the busiest home / C)"
    )
    for row in rows:
        cells = []
        for n in names:
            cell = row[f"C={n}"]
            cells.append(
                f"{cell['after']:7.4f} {cell['exports_max']:2d}/{cell['bound']:<3d}"
            )
        print(
            f"{row['shards']:3d} {row['hot']:>10} {row['slots']:2d} " + " ".join(cells),
            flush=True,
        )
    return rows


def assign_timing(args) -> dict:
    num_shards, num_slots = max(args.shards), 2
    choices = wl.sample_workload(
        "zipf",
        num_shards=num_shards,
        tokens=args.tokens,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        s=1.2,
        hot="contiguous",
        seed=args.seed,
    )
    counts = jnp.asarray(wl.counts_from_choices(choices, NUM_EXPERTS))
    plan = jitted_plan(num_slots)(counts)
    fn = jax.jit(
        functools.partial(
            assign_destinations, num_local_experts=NUM_EXPERTS // num_shards
        )
    )
    experts = jnp.asarray(choices[0])
    timing = _time(fn, plan, counts, experts, jnp.int32(0), reps=args.reps)
    return dict(shards=num_shards, slots=num_slots, tokens=args.tokens, **timing)


def communication(args, busiest_home: dict) -> list[dict]:
    expert_bytes = 3 * D_MODEL * D_FF * BYTES_BF16  # w_gate_up [H, 2F] + w_down [F, H]
    rows = []
    for num_shards in args.shards:
        for num_slots in args.slots:
            # All-gather of the [S, ...] slot gradients and [S] indices of every shard.
            gather_recv = (num_shards - 1) * num_slots * (expert_bytes + BYTES_INDEX)
            gather_buffer = num_shards * num_slots * expert_bytes
            # Naive: psum of a global [E, ...] gradient (ring all-reduce traffic).
            psum_traffic = (
                2 * (num_shards - 1) / num_shards * NUM_EXPERTS * expert_bytes
            )
            psum_buffer = NUM_EXPERTS * expert_bytes
            # Targeted: each slot gradient goes to its home shard only; the busiest
            # home shard receives one gradient per copy of its experts (measured on
            # the contiguous Zipf plans, where copies concentrate on few homes).
            busiest = busiest_home[(num_shards, num_slots)]
            rows.append(
                dict(
                    shards=num_shards,
                    slots=num_slots,
                    expert_grad_mib=expert_bytes / 2**20,
                    allgather_recv_gib=gather_recv / 2**30,
                    allgather_buffer_gib=gather_buffer / 2**30,
                    targeted_send_gib=num_slots * expert_bytes / 2**30,
                    targeted_recv_max_gib=busiest * expert_bytes / 2**30,
                    targeted_recv_max_copies=busiest,
                    psum_traffic_gib=psum_traffic / 2**30,
                    psum_buffer_gib=psum_buffer / 2**30,
                    allgather_vs_psum_traffic=gather_recv / psum_traffic,
                )
            )
    return rows


def _busiest_home(args) -> dict:
    """Max over home shards of slot copies of its experts, contiguous Zipf(max s)."""
    out = {}
    for num_shards in args.shards:
        choices = wl.sample_workload(
            "zipf",
            num_shards=num_shards,
            tokens=args.tokens,
            num_experts=NUM_EXPERTS,
            top_k=TOP_K,
            s=max(args.zipf),
            hot="contiguous",
            seed=args.seed,
        )
        counts = jnp.asarray(wl.counts_from_choices(choices, NUM_EXPERTS))
        local = NUM_EXPERTS // num_shards
        for num_slots in args.slots:
            slots = np.asarray(jitted_plan(num_slots)(counts).slot_expert)
            homes = slots[slots >= 0] // local
            out[(num_shards, num_slots)] = int(
                np.bincount(homes, minlength=num_shards).max() if homes.size else 0
            )
    return out


def _best_split(placement: np.ndarray, counts_e: np.ndarray, local: int) -> float:
    """Lowest max shard load reachable on a fixed placement (LP over the quotas)."""
    num_experts = counts_e.shape[0]
    num_shards = num_experts // local
    holds = np.zeros((num_experts, num_shards), bool)
    holds[np.arange(num_experts), np.arange(num_experts) // local] = True
    for r in range(num_shards):
        for e in placement[r]:
            if e >= 0:
                holds[e, r] = True
    expert_idx, shard_idx = np.nonzero(holds)
    num_vars = len(expert_idx) + 1  # quotas, then the max load z
    cost = np.zeros(num_vars)
    cost[-1] = 1.0
    a_eq = np.zeros((num_experts, num_vars))
    a_eq[expert_idx, np.arange(len(expert_idx))] = 1.0
    a_ub = np.zeros((num_shards, num_vars))
    a_ub[shard_idx, np.arange(len(expert_idx))] = 1.0
    a_ub[:, -1] = -1.0
    result = linprog(
        cost,
        A_ub=a_ub,
        b_ub=np.zeros(num_shards),
        A_eq=a_eq,
        b_eq=counts_e.astype(np.float64),
        bounds=(0, None),
        method="highs",
    )
    if not result.success:
        raise RuntimeError(result.message)
    return float(result.x[-1])


def static_vs_dynamic(args) -> list[dict]:
    num_shards, num_slots = args.static_shards, 2
    local = NUM_EXPERTS // num_shards
    fn = jitted_plan(num_slots)
    rows = []
    for name in ("rotating_hotspot", "drifting_zipf"):
        history = []
        scores = {
            "none": [],
            "per_step": [],
            "per_step_unbounded": [],
            "static_split": [],
            "static_best": [],
        }
        placement = fractions = None
        for step in range(args.steps):
            choices = wl.sample_workload(
                name,
                num_shards=num_shards,
                tokens=args.static_tokens,
                num_experts=NUM_EXPERTS,
                top_k=TOP_K,
                seed=args.seed,
                step=step,
                hot="random",
                drift=args.drift,
            )
            counts = wl.counts_from_choices(choices, NUM_EXPERTS)
            counts_e = counts.sum(axis=0)
            if step >= args.window and step % args.window == 0:
                window = np.sum(history[-args.window :], axis=0)
                stale = fn(jnp.asarray(window))
                placement = np.asarray(stale.slot_expert)
                quota = np.asarray(stale.expert_shard_pairs, np.float64)
                total = quota.sum(axis=1, keepdims=True)
                home = np.arange(NUM_EXPERTS)[:, None] // local == np.arange(num_shards)
                fractions = np.where(total > 0, quota / np.maximum(total, 1), home)
            history.append(counts)
            if placement is None:
                continue  # no history yet: the static placement does not exist
            mean = counts.sum() / num_shards
            scores["none"].append(max_over_mean(_home_load(counts)))
            scores["per_step"].append(max_over_mean(fn(jnp.asarray(counts)).shard_load))
            # The same without the out-degree bound (default C), for comparison.
            unbounded = _jitted_bounded(num_slots)(
                jnp.asarray(counts), max_exports=jnp.int32(num_shards * num_slots)
            )
            scores["per_step_unbounded"].append(max_over_mean(unbounded.shard_load))
            scores["static_split"].append(
                float((counts_e[:, None] * fractions).sum(axis=0).max() / mean)
            )
            scores["static_best"].append(_best_split(placement, counts_e, local) / mean)
        row = dict(
            workload=name,
            shards=num_shards,
            slots=num_slots,
            window=args.window,
            steps_scored=len(scores["none"]),
        )
        for key, values in scores.items():
            row[f"{key}_mean"] = float(np.mean(values))
            row[f"{key}_max"] = float(np.max(values))
        rows.append(row)
        print(
            f"{name:17s} R={num_shards} S={num_slots} W={args.window}: max/mean "
            + "  ".join(
                f"{key} {row[key + '_mean']:.3f} (worst {row[key + '_max']:.3f})"
                for key in scores
            ),
            flush=True,
        )
    return rows


def compile_times(args) -> list[dict]:
    """Seconds to compile the planner, alone and with `assign_destinations` (as one
    program), min over `args.compile_reps` fresh compiles run round-robin."""

    def programs(num_shards, num_experts, num_slots, tokens, top_k):
        counts = jnp.ones((num_shards, num_experts), jnp.int32)
        experts = jnp.zeros((tokens, top_k), jnp.int32)
        local = num_experts // num_shards

        def plan(counts):
            return plan_duplication(counts, num_slots=num_slots)

        def both(counts, experts):
            return assign_destinations(
                plan(counts), counts, experts, 0, num_local_experts=local
            )

        return {"plan": (plan, (counts,)), "plan+assign": (both, (counts, experts))}

    best, kernels = {}, {}
    for _ in range(args.compile_reps):
        for shape in args.compile_shapes:
            for kind, (fn, fn_args) in programs(*shape).items():
                # A new function each time: nothing is reused from a cache.
                start = time.perf_counter()
                compiled = jax.jit(lambda *a, fn=fn: fn(*a)).lower(*fn_args).compile()
                seconds = time.perf_counter() - start
                key = (shape, kind)
                best[key] = min(best.get(key, float("inf")), seconds)
                kernels[key] = compiled.as_text().count(" fusion(")
    rows = []
    for shape in args.compile_shapes:
        num_shards, num_experts, num_slots, tokens, top_k = shape
        row = dict(
            shards=num_shards,
            experts=num_experts,
            slots=num_slots,
            tokens=tokens,
            top_k=top_k,
        )
        for kind in ("plan", "plan+assign"):
            row[f"{kind}_s"] = best[shape, kind]
            row[f"{kind}_fusions"] = kernels[shape, kind]
        rows.append(row)
        print(
            f"R={num_shards:3d} E={num_experts:3d} S={num_slots}: "
            f"plan {row['plan_s']:.3f} s ({row['plan_fusions']} fusions)  "
            f"plan+assign {row['plan+assign_s']:.3f} s "
            f"({row['plan+assign_fusions']} fusions)",
            flush=True,
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny run (seconds)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per shard")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument(
        "--compile-reps", type=int, default=3, help="compiles per compile-time row"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--drift", type=float, default=0.1, help="drifting Zipf: log-weight walk/step"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path(__file__).parent / "results" / "planner.json",
    )
    args = parser.parse_args()
    args.shards, args.zipf, args.slots = [8, 16, 32, 64], [0.8, 1.0, 1.2], [1, 2, 4]
    args.hot = ["spread", "contiguous", "random"]
    args.static_shards, args.static_tokens, args.steps, args.window = 32, 1024, 60, 10
    args.goal_shards, args.degree_shards, args.goal_tokens = [32, 64], [8, 32, 64], 1024
    args.compile_shapes = COMPILE_SHAPES
    if args.quick:
        args.compile_shapes, args.compile_reps = COMPILE_SHAPES[:1], 1
        args.shards, args.zipf, args.slots = [8], [1.2], [1, 2]
        # R = 8 everywhere: the goals then reuse the balance rows' compiled plans.
        args.goal_shards, args.degree_shards = [8], [8]
        args.hot = ["spread", "contiguous"]
        args.tokens, args.reps = min(args.tokens, 256), 5
        args.static_shards, args.static_tokens, args.steps, args.window = 8, 128, 6, 2

    config = dict(
        experts=NUM_EXPERTS,
        top_k=TOP_K,
        tokens_per_shard=args.tokens,
        shards=args.shards,
        zipf_s=args.zipf,
        hot=args.hot,
        slots=args.slots,
        drift=args.drift,
        quick=args.quick,
        backend=jax.default_backend(),
        cpu_count=os.cpu_count(),
        machine=platform.machine(),
        jax=jax.__version__,
    )
    print(f"config: {config}")
    print("\n== balance (rank load max/mean, home only -> planned) ==")
    balance_rows = balance(args)
    print(
        f"\n== goals (E={NUM_EXPERTS}, k={TOP_K}, {args.goal_tokens} tokens per shard,"
        f" Zipf(1.2), default bound C) =="
    )
    goal_rows = goals(args)
    print("\n== out-degree bound C (same loads) ==")
    degree_rows = out_degree(args)
    print("\n== assign_destinations (one shard) ==")
    assign = assign_timing(args)
    print(
        f"R={assign['shards']} S={assign['slots']} T={assign['tokens']} k={TOP_K}: "
        f"{assign['median_us']:.0f} us median"
    )
    print(f"\n== slot-gradient backward communication (H={D_MODEL}, F={D_FF}, bf16) ==")
    comm = communication(args, _busiest_home(args))
    print(
        f"{'R':>3} {'S':>2} {'all-gather recv':>16} {'buffer':>10} "
        f"{'targeted recv (max)':>24} {'psum traffic':>13} {'buffer':>10} "
        f"{'ag/psum':>8}"
    )
    for row in comm:
        targeted = (
            f"{row['targeted_recv_max_gib']:.2f} GiB "
            f"({row['targeted_recv_max_copies']} grads)"
        )
        print(
            f"{row['shards']:3d} {row['slots']:2d} "
            f"{row['allgather_recv_gib']:12.2f} GiB "
            f"{row['allgather_buffer_gib']:6.2f} GiB "
            f"{targeted:>24} "
            f"{row['psum_traffic_gib']:9.2f} GiB {row['psum_buffer_gib']:6.2f} GiB "
            f"{row['allgather_vs_psum_traffic']:8.3f}"
        )
    print("\n== per-step planning vs periodic static placement ==")
    static = static_vs_dynamic(args)
    print(f"\n== compile time (min of {args.compile_reps}) ==")
    compile_rows = compile_times(args)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(
        config=config,
        balance=balance_rows,
        goals=goal_rows,
        out_degree=degree_rows,
        assign=assign,
        communication=comm,
        static_vs_dynamic=static,
        compile=compile_rows,
    )
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
