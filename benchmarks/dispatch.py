"""Wire rows and bytes with and without dedup, against the analytic count, and the
compiled memory of the expert-parallel layer with a capped vs worst-case buffer.

    python3 benchmarks/dispatch.py [--quick]   # --quick: EP 8 and 16, forward memory only

The wire counts come from `moe_eqx.send_counts`, the function the layer itself uses
to size its exchange, applied to synthetic routing of every shard (no devices needed).
"""

import argparse
import math

from _common import compiled_memory, print_table, setup_devices, write_json

setup_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402

import moe_eqx as me  # noqa: E402
import moe_eqx.internal as mi  # noqa: E402
import moe_eqx.workloads as wl  # noqa: E402


def analytic_distinct_uniform(num_experts: int, k: int, num_shards: int) -> float:
    """E[#distinct shards per token] when k distinct experts are drawn uniformly."""
    local = num_experts // num_shards
    miss = math.comb(num_experts - local, k) / math.comb(num_experts, k)
    return num_shards * (1.0 - miss)


def wire_counts(choices: np.ndarray, num_experts: int, dedup: bool) -> int:
    r = choices.shape[0]
    local = num_experts // r
    dest = jnp.asarray(choices // local, jnp.int32)
    valid = jnp.ones(dest.shape[1:], bool)
    counts = jax.jit(
        jax.vmap(lambda d: mi.send_counts(d, valid, num_shards=r, dedup=dedup))
    )(dest)
    return int(jnp.sum(counts))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--d-model", type=int, default=7168, help="for wire bytes (bf16)")
    args = p.parse_args()
    num_experts, k = 256, 8
    tokens = 64 if args.quick else 512
    eps = [8, 16] if args.quick else [8, 16, 32, 64]
    rows = []
    for r in eps:
        for workload in ("uniform", "zipf1.2"):
            probs = (
                wl.uniform_probs(num_experts)
                if workload == "uniform"
                else wl.zipf_probs(num_experts, s=1.2, hot="spread", num_shards=r)
            )
            choices = wl.sample_choices(
                probs, num_shards=r, tokens=tokens, top_k=k, seed=r
            )
            pairs = choices.shape[0] * tokens * k
            rows_plain = wire_counts(choices, num_experts, dedup=False)
            rows_dedup = wire_counts(choices, num_experts, dedup=True)
            local = num_experts // r
            exact = sum(
                len(set(row)) for row in (choices // local).reshape(-1, k).tolist()
            )
            expected = (
                analytic_distinct_uniform(num_experts, k, r) * r * tokens
                if workload == "uniform"
                else float("nan")
            )
            # Bytes: bf16 activation once per row, plus (int32 group, f32 weight) per
            # carried pair entry (k entries per row with dedup, 1 without).
            b_plain = rows_plain * (2 * args.d_model + 8)
            b_dedup = rows_dedup * (2 * args.d_model + 8 * k)
            rows.append(
                dict(
                    ep=r,
                    routing=workload,
                    pairs=pairs,
                    rows_nodedup=rows_plain,
                    rows_dedup=rows_dedup,
                    exact_distinct=exact,
                    analytic_expected=expected,
                    row_saving=1 - rows_dedup / rows_plain,
                    byte_saving=1 - b_dedup / b_plain,
                )
            )
            assert rows_plain == pairs
            assert rows_dedup == exact, "dedup rows must equal distinct (token, shard)"
    print(f"Wire rows per step, E={num_experts}, k={k}, {tokens} tokens per shard")
    print_table(
        rows,
        [
            "ep",
            "routing",
            "pairs",
            "rows_nodedup",
            "rows_dedup",
            "exact_distinct",
            "analytic_expected",
            "row_saving",
            "byte_saving",
        ],
    )

    # Compiled memory of the layer at EP8: capped buffer (1.25) vs worst case (None).
    mesh = jax.make_mesh((8,), ("expert",))
    mem_rows = []
    t_total = 1024 if args.quick else 8192
    for bf in (1.25, None):
        cfg = me.MoEConfig(
            d_model=128,
            d_ff=256,
            num_experts=64,
            top_k=8,
            buffer_factor=bf,
            on_overflow="drop",
        )
        layer = me.MoELayer(cfg, key=jr.key(0))
        # Floating-point parameters: `expert_ids` is an integer array.
        params, static = eqx.partition(layer, eqx.is_inexact_array)
        x = jnp.zeros((t_total, 128), jnp.float32)

        def fwd(p, x, static=static):
            return eqx.combine(p, static)(x, mesh=mesh)[0]

        def grad(p, x, static=static):
            return jax.grad(lambda p: jnp.sum(fwd(p, x)))(p)

        # Quick: the forward only (each program takes seconds to compile).
        passes = (("forward", fwd), ("fwd+bwd", grad))
        for label, fn in passes[:1] if args.quick else passes:
            m = compiled_memory(fn, params, x)
            mem_rows.append(dict(buffer_factor=str(bf), pass_=label, **m))
    for label in ("forward",) if args.quick else ("forward", "fwd+bwd"):
        capped, worst = (r for r in mem_rows if r["pass_"] == label)
        capped["vs_worst"] = capped["peak_mib"] / worst["peak_mib"]
        worst["vs_worst"] = 1.0
    print(f"\nCompiled per-device memory, EP8, E=64, k=8, {t_total} tokens (drop mode)")
    print_table(
        mem_rows,
        ["buffer_factor", "pass_", "temp_mib", "output_mib", "peak_mib", "vs_worst"],
    )
    write_json("dispatch", {"wire": rows, "memory": mem_rows, "quick": args.quick})


if __name__ == "__main__":
    main()
