"""Where the EP8 layer's compile time goes: each phase, and each slot stage.

    python3 benchmarks/compile_stages.py              # min of 3 compilations each
    python3 benchmarks/compile_stages.py --repeats 1

The programs and the baseline are those of `benchmarks/compile.py` (forward+backward,
T=1024, d_model=64, d_ff=128, E=16, top-2, 8 simulated CPU devices). Each is timed
in three phases from empty jax caches: tracing (`jax.jit(f).trace`), lowering to
StableHLO (`.lower()`) and XLA's compilation (`.compile()`: HLO passes, then LLVM
for every kernel).

The last four rows take the `+ 1 slot` layer and replace one or all of its three
slot stages by a trivial stand-in, to measure what each stage costs to compile:

- `planner`: `plan_duplication` returns an empty plan (no slot filled);
- `assign`: every pair goes to its expert's home shard (no sort, no search);
- `slot weights`: the slot groups' weights are zeros (no exchange, no custom
    backward).

A stand-in changes only that stage: the rest of the program (the slot group in
the grouped matmul, the predicate and the fallback) is compiled as before. These
programs are for timing only (with the weights replaced, a slot that receives pairs
computes with zero weights). Writes benchmarks/results/compile_stages.json.
"""

import argparse
import os
import platform
import sys
import time

from _common import print_table, setup_devices, write_json

setup_devices(8)

import compile as cb  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import moe_eqx as me  # noqa: E402
from moe_eqx import _planner, _shard  # noqa: E402

_REAL = {
    "planner": ("plan_duplication", _shard.plan_duplication),
    "assign": ("assign_destinations", _shard.assign_destinations),
    "slot weights": ("gather_slot_weights", _shard.gather_slot_weights),
}


def _empty_plan(counts, *, num_slots, max_exports, max_pairs):
    del max_exports, max_pairs
    num_shards = counts.shape[0]
    pairs = counts.astype(jnp.int32).sum(axis=0)
    plan = _planner._home_only(pairs, num_shards, num_slots)
    # Data-dependent, so that XLA cannot fold the slot table into the program.
    empty = jnp.full((num_shards, num_slots), -1, jnp.int32) + (pairs.sum() < 0)
    return _planner.DuplicationPlan(empty, plan.expert_shard_pairs)


def _home_destinations(plan, counts, experts, shard, *, num_local_experts):
    del plan, counts, shard
    return experts // num_local_experts, experts % num_local_experts


def _zero_slot_weights(w_home, slot_expert, num_local, axis_name, **kwargs):
    del num_local, axis_name, kwargs

    def one(w):
        zeros = jnp.zeros((slot_expert.shape[1], *w.shape[1:]), w.dtype)
        return jnp.concatenate([w, zeros])

    return jax.tree.map(one, w_home)


_STAND_INS = {
    "planner": _empty_plan,
    "assign": _home_destinations,
    "slot weights": _zero_slot_weights,
}


def _use(replaced: tuple[str, ...]) -> None:
    for stage, (name, real) in _REAL.items():
        setattr(_shard, name, _STAND_INS[stage] if stage in replaced else real)


def phases(make) -> tuple[float, float, float]:
    """Seconds to trace, lower and compile `make()`'s program from empty caches."""
    jax.clear_caches()
    fn, args = make()
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="tries per program")
    args = parser.parse_args(argv)
    mesh = cb.model_mesh()
    base = dict(d_model=cb.D, d_ff=cb.F, num_experts=cb.E, top_k=cb.K)

    def layer(**kw):
        return lambda: cb.layer_program(me.MoEConfig(**base, **kw), mesh)

    slot = layer(num_slots=1)
    programs = [
        ("minimal EP8", lambda: cb.minimal_program(mesh), ()),
        ("EP8 drop", layer(on_overflow="drop"), ()),
        ("EP8 fallback", layer(), ()),
        ("EP8 fallback + 1 slot", slot, ()),
        ("+ 1 slot, planner replaced", slot, ("planner",)),
        ("+ 1 slot, assign replaced", slot, ("assign",)),
        ("+ 1 slot, slot weights replaced", slot, ("slot weights",)),
        ("+ 1 slot, all three replaced", slot, tuple(_REAL)),
    ]
    times = {name: [] for name, _, _ in programs}
    try:
        for _ in range(args.repeats):  # round-robin: each sees the same load
            for name, make, replaced in programs:
                _use(replaced)
                times[name].append(phases(make))
    finally:
        _use(())
    baseline = min(sum(t) for t in times["minimal EP8"])
    rows = []
    for name, _, replaced in programs:
        ts = times[name]
        total = min(sum(t) for t in ts)
        rows.append(
            {
                "program": name,
                "total_s": total,
                "ratio": total / baseline,
                "trace_s": min(t[0] for t in ts),
                "lower_s": min(t[1] for t in ts),
                "xla_s": min(t[2] for t in ts),
                "replaced": list(replaced),
            }
        )
    columns = ["program", "total_s", "ratio", "trace_s", "lower_s", "xla_s"]
    print_table(rows, columns)
    write_json(
        "compile_stages",
        {
            "shapes": dict(tokens=cb.T, d_model=cb.D, d_ff=cb.F, experts=cb.E),
            "repeats": args.repeats,
            "jax": jax.__version__,
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
