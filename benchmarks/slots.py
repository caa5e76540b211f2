"""Slot weights of duplicated experts: per-device memory and wire bytes vs EP size.

For each EP size R (E = 256 experts, L = E / R, S slots, C = the planner's
`default_max_exports(R, L, S)`), the slot path's forward and both backward modes
(`all_gather`, `home`) against the global `[E, ...]` baseline (all-gather every expert
forward, psum a global `[E, ...]` gradient backward) that the upstream review rejected.

- Memory, "copies": expert-sized buffers per device. `ragged` (GPU/TPU) is analytic
  (its buffers are exactly `[C]` and `[S]`: XLA:CPU cannot compile the collective);
  `dense` and the baseline are measured: each R is compiled in a subprocess with R
  simulated CPU devices (no execution), at two small expert sizes, and the slope of
  `memory_analysis().temp_size_in_bytes` over the expert size is the copy count (the
  slope removes the O(R^2 S) integer index tables).
- Wire: bytes one device sends or receives (the larger), at DeepSeek-V3 expert sizes
  (d_model 7168, d_ff 2048, bf16: 84 MiB per expert, gate/up and down together), from
  the collectives' byte counts: ragged trips move only filled slots (worst case: a home
  shard exports C copies); `all_to_all` moves every block; an all-gather of `n`
  per-device bytes receives `(R - 1) n`; a ring psum of `n` bytes sends `2 (R-1)/R n`.

Usage:

    python3 benchmarks/slots.py            # R = 8 ... 256, S = 1, 2 (a few minutes)
    python3 benchmarks/slots.py --quick    # R = 8, 16, S = 2 (seconds)
"""

import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _common import print_table, write_json  # noqa: E402

NUM_EXPERTS = 256
D_MODEL, D_FF = 7168, 2048
EXPERT_BYTES = 3 * D_MODEL * D_FF * 2  # w_gate_up [H, 2F] + w_down [F, H], bf16
# Small float32 expert shapes for the compiled measurement (the slope between them).
SMALL_SHAPES = ((32, 64), (64, 64))
PROGRAMS = ("forward", "backward_all_gather", "backward_home", "psum_fwd", "psum_bwd")


def _worker(num_shards: int, num_slots: int, max_exports: int) -> dict:
    """Compiled temp bytes of every program at each small shape (runs with R devices)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import moe_eqx.internal as mi

    num_local = NUM_EXPERTS // num_shards
    mesh = jax.make_mesh(
        (num_shards,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    # Any table within the bound: the compiled buffers depend on shapes only.
    table = jax.ShapeDtypeStruct((num_shards, num_slots), jnp.int32)

    def slots(w, t, backward):
        return mi.gather_slot_weights(
            w, t, num_local, "expert", max_exports=max_exports, backward=backward
        )

    def baseline_fwd(w, t):
        every = jax.lax.all_gather(w, "expert", tiled=True)  # [E, ...]
        me_ = jax.lax.axis_index("expert")
        return every[jnp.maximum(t[me_], 0)]

    def baseline_bwd(g, t):
        me_ = jax.lax.axis_index("expert")
        full = jnp.zeros((NUM_EXPERTS, *g.shape[1:]), g.dtype)
        full = full.at[jnp.maximum(t[me_], 0)].add(g)
        full = jax.lax.psum(full, "expert")  # [E, ...] on every device
        return jax.lax.dynamic_slice_in_dim(full, me_ * num_local, num_local)

    def per_shard(program):
        if program == "forward":
            return lambda w, t, g: slots(w, t, "all_gather")
        if program == "psum_fwd":
            return lambda w, t, g: baseline_fwd(w, t)
        if program == "psum_bwd":
            return lambda w, t, g: baseline_bwd(g, t)
        mode = program.removeprefix("backward_")
        # The forward's output is unused, so only the backward is compiled.
        return lambda w, t, g: jax.grad(lambda w: jnp.sum(slots(w, t, mode) * g))(w)

    out = {}
    for shape in SMALL_SHAPES:
        w = jax.ShapeDtypeStruct((NUM_EXPERTS, *shape), jnp.float32)
        g = jax.ShapeDtypeStruct((num_shards * num_slots, *shape), jnp.float32)
        for program in PROGRAMS:
            f = jax.shard_map(
                per_shard(program),
                mesh=mesh,
                in_specs=(P("expert"), P(), P("expert")),
                out_specs=P("expert"),
                check_vma=False,
            )
            ma = jax.jit(f).lower(w, table, g).compile().memory_analysis()
            out[f"{program}@{shape[0] * shape[1]}"] = ma.temp_size_in_bytes
    return out


def _measure(num_shards: int, num_slots: int, max_exports: int) -> dict:
    """Expert-sized buffers per device of every program, from a subprocess."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={num_shards}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, __file__, "--worker", str(num_shards), str(num_slots)]
    cmd.append(str(max_exports))
    raw = json.loads(
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    (a, b) = [s[0] * s[1] for s in SMALL_SHAPES]
    # float32 elements: bytes per expert = 4 * size.
    return {p: (raw[f"{p}@{b}"] - raw[f"{p}@{a}"]) / (4 * (b - a)) for p in PROGRAMS}


def _analytic(num_shards: int, num_slots: int, max_exports: int) -> dict:
    """Buffers (expert copies) and wire copies per device of each path."""
    from moe_eqx._slots import slot_backward_copies

    r, s, c, e = num_shards, num_slots, max_exports, NUM_EXPERTS
    block = min(s, c)
    sizes = dict(num_shards=r, num_slots=s, max_exports=c)
    return {
        "fwd_ragged": s + c,  # [C] export buffer + [S] receive buffer
        "fwd_dense": 2 * r * block,
        "bwd_all_gather": slot_backward_copies(
            "all_gather", exchange="ragged", **sizes
        ),
        "bwd_home_ragged": slot_backward_copies("home", exchange="ragged", **sizes),
        "bwd_home_dense": slot_backward_copies("home", exchange="dense", **sizes),
        "psum": e,
        "wire_fwd_ragged": max(s, c),
        "wire_fwd_dense": (r - 1) * block,
        "wire_bwd_all_gather": (r - 1) * s,
        "wire_bwd_home_ragged": max(s, c),
        "wire_psum_fwd": e - e // r,
        "wire_psum_bwd": 2 * (r - 1) / r * e,
    }


def _row(num_shards: int, num_slots: int, compiled: bool) -> dict:
    from moe_eqx._planner import default_max_exports
    from moe_eqx._slots import choose_slot_backward

    local = NUM_EXPERTS // num_shards
    c = max(1, default_max_exports(num_shards, local, num_slots))
    a = _analytic(num_shards, num_slots, c)
    gib = EXPERT_BYTES / 2**30
    row = {
        "R": num_shards,
        "L": local,
        "S": num_slots,
        "C": c,
        "auto_ragged": choose_slot_backward(
            "auto",
            num_shards=num_shards,
            num_slots=num_slots,
            max_exports=c,
            exchange="ragged",
        ),
        "auto_dense": choose_slot_backward(
            "auto",
            num_shards=num_shards,
            num_slots=num_slots,
            max_exports=c,
            exchange="dense",
        ),
        "analytic_copies": a,
        "fwd_ragged_gib": a["fwd_ragged"] * gib,
        "bwd_ag_gib": a["bwd_all_gather"] * gib,
        "bwd_home_ragged_gib": a["bwd_home_ragged"] * gib,
        "psum_gib": a["psum"] * gib,
        "wire_fwd_ragged_gib": a["wire_fwd_ragged"] * gib,
        "wire_bwd_ag_gib": a["wire_bwd_all_gather"] * gib,
        "wire_bwd_home_gib": a["wire_bwd_home_ragged"] * gib,
        "wire_psum_bwd_gib": a["wire_psum_bwd"] * gib,
    }
    if compiled:
        m = _measure(num_shards, num_slots, c)
        row["compiled_copies"] = m
        row.update(
            {
                "c_fwd_dense": round(m["forward"], 1),
                "c_bwd_ag": round(m["backward_all_gather"], 1),
                "c_bwd_home_dense": round(m["backward_home"], 1),
                "c_psum_fwd": round(m["psum_fwd"], 1),
                "c_psum_bwd": round(m["psum_bwd"], 1),
            }
        )
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="R = 8, 16, S = 2")
    parser.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-compile", action="store_true", help="analytic columns only"
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="JSON path (default results/)"
    )
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(*args.worker)))
        return
    shards = [8, 16] if args.quick else [8, 16, 32, 64, 128, 256]
    slot_counts = [2] if args.quick else [1, 2]
    # Each row compiles in its own subprocess: run as many at once as there are cores.
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        rows = list(
            pool.map(
                lambda rs: _row(*rs, not args.no_compile),
                [(r, s) for s in slot_counts for r in shards],
            )
        )
    print(
        "Per-device expert-sized buffers (copies) of the slot path; ragged analytic, "
        "c_* compiled (dense exchange on CPU, and the [E] baseline)"
    )
    print_table(
        rows,
        ["R", "L", "S", "C", "auto_ragged", "auto_dense"]
        + (
            ["c_fwd_dense", "c_bwd_ag", "c_bwd_home_dense", "c_psum_fwd", "c_psum_bwd"]
            if not args.no_compile
            else []
        ),
    )
    print(
        f"\nDeepSeek-V3 sizes ({EXPERT_BYTES / 2**20:.0f} MiB per expert, bf16): "
        "buffers and wire GiB per device, ragged slot path vs the [E] psum"
    )
    print_table(
        rows,
        ["R", "S", "C", "fwd_ragged_gib", "bwd_ag_gib", "bwd_home_ragged_gib"]
        + ["psum_gib", "wire_fwd_ragged_gib", "wire_bwd_ag_gib", "wire_bwd_home_gib"]
        + ["wire_psum_bwd_gib"],
    )
    payload = {
        "config": {
            "num_experts": NUM_EXPERTS,
            "d_model": D_MODEL,
            "d_ff": D_FF,
            "expert_bytes": EXPERT_BYTES,
            "small_shapes": SMALL_SHAPES,
            "quick": args.quick,
        },
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2, default=float))
        print(f"\nwrote {args.out}")
    else:
        write_json("slots_quick" if args.quick else "slots", payload)


if __name__ == "__main__":
    main()
