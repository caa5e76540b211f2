"""Peak memory and runtime of the chunked dropless fallback.

    python3 benchmarks/fallback.py [--quick]

Memory: compiled per-device `memory_analysis()` (temp + output) at EP8 on CPU of three
layers that differ only in what happens on overflow: capped-only (`on_overflow="drop"`),
capped + fallback (the default), and a worst-case buffer (`buffer_factor=None`).
Runtime: one step of the default layer when the routing overflows (the fallback runs)
against the same step with `on_overflow="drop"` (the capped path runs).
"""

import argparse
import time

from _common import compiled_memory, print_table, setup_devices, write_json

setup_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402

import moe_eqx as me  # noqa: E402

D, F, E, K = 256, 512, 32, 4


def make(bf, on_overflow, bias=None):
    cfg = me.MoEConfig(
        d_model=D,
        d_ff=F,
        num_experts=E,
        top_k=K,
        buffer_factor=bf,
        on_overflow=on_overflow,
        use_router_bias=True,
    )
    layer = me.MoELayer(cfg, key=jr.PRNGKey(0))
    if bias is not None:
        layer = eqx.tree_at(lambda l: l.router.bias, layer, bias)
    return eqx.partition(layer, eqx.is_array)


def fns(static, mesh):
    def fwd(p, x):
        return eqx.combine(p, static)(x, mesh=mesh)[0]

    def step(p, x):
        def loss(p):
            y, stats = eqx.combine(p, static)(x, mesh=mesh)
            return jnp.sum(y * y), stats

        return jax.grad(loss, has_aux=True)(p)

    return fwd, step


def timeit(f, *args, repeats):
    out = f(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    mesh = jax.make_mesh((8,), ("expert",))
    token_counts = [1024] if args.quick else [2048, 8192, 32768]
    rows = []
    for t in token_counts:
        x = jnp.zeros((t, D), jnp.float32)
        variants = {
            "capped-only": make(2.0, "drop"),
            "capped+fallback": make(2.0, "fallback"),
            "worst-case": make(None, "fallback"),
        }
        for label in ("forward", "fwd+bwd"):
            res = {}
            for name, (params, static) in variants.items():
                fwd, step = fns(static, mesh)
                res[name] = compiled_memory(
                    fwd if label == "forward" else step, params, x
                )
            base = res["capped-only"]["peak_mib"]
            for name, m in res.items():
                rows.append(
                    dict(
                        tokens=t,
                        pass_=label,
                        layer=name,
                        **m,
                        vs_capped=m["peak_mib"] / base,
                    )
                )
    print(f"Compiled per-device memory, EP8, d_model={D}, d_ff={F}, E={E}, k={K}")
    print_table(
        rows,
        ["tokens", "pass_", "layer", "temp_mib", "output_mib", "peak_mib", "vs_capped"],
    )

    # Runtime: every token prefers shard 0's experts, so the 2x buffer overflows.
    t = 1024 if args.quick else 8192
    x = jr.normal(jr.PRNGKey(1), (t, D), jnp.float32)
    bias = jnp.zeros((E,), jnp.float32).at[: E // 8].set(5.0)
    timing = []
    for name, oo in (("capped (drop)", "drop"), ("fallback", "fallback")):
        params, static = make(2.0, oo, bias)
        fwd, step = fns(static, mesh)
        for label, f in (("forward", fwd), ("fwd+bwd", step)):
            sec, out = timeit(jax.jit(f), params, x, repeats=2 if args.quick else 5)
            row = dict(path=name, pass_=label, ms=1e3 * sec)
            if label == "fwd+bwd":
                stats = out[1]
                row.update(
                    overflow=bool(stats.overflow),
                    fallback_used=bool(stats.fallback_used),
                    num_chunks=int(stats.num_chunks),
                    dropped_pairs=int(stats.dropped_pairs),
                )
            timing.append(row)
    for label in ("forward", "fwd+bwd"):
        capped, fb = (r for r in timing if r["pass_"] == label)
        fb["vs_capped"] = fb["ms"] / capped["ms"]
        capped["vs_capped"] = 1.0
    print(f"\nStep time when the routing overflows, EP8, {t} tokens")
    print_table(
        timing,
        [
            "path",
            "pass_",
            "ms",
            "vs_capped",
            "overflow",
            "fallback_used",
            "num_chunks",
            "dropped_pairs",
        ],
    )
    write_json("fallback", {"memory": rows, "timing": timing, "quick": args.quick})


if __name__ == "__main__":
    main()
