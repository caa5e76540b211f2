"""Peak memory and runtime of the chunked dropless fallback.

    python3 benchmarks/fallback.py [--quick]

Memory: compiled per-device `memory_analysis()` (temp + output) at EP8 on CPU of three
layers that differ only in what happens on overflow: capped-only (`on_overflow="drop"`),
capped + fallback (the default), and a worst-case buffer (`buffer_factor=None`).
`--quick`: a small layer (d_model=64, d_ff=128, E=8, k=2) at EP4, 256 tokens, capped-only
and capped + fallback, compiled at -O0: a smoke run of the same code in seconds.

Runtime: one step of the default layer against the same step with `on_overflow="drop"`
(the capped path), interleaved, min over repeats: with routing that does not overflow
(the price of having the fallback compiled in) and with routing that does (the
fallback runs). Each program is compiled once, for its memory and its timings.
"""

import argparse
import os
import sys

if "--quick" in sys.argv:
    # A smoke run: XLA's CPU backend at -O0 compiles the steps in about half the time
    # (the memory analysis is the same; the times are not a measurement).
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0"

from _common import interleaved_min, print_table, setup_devices, write_json

setup_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402

import moe_eqx as me  # noqa: E402

# d_model, d_ff, experts, top-k, EP size, token counts (full run; `--quick`: a small
# layer on four devices, the two layers that matter, compiled once each).
FULL = dict(D=256, F=512, E=32, K=4, R=8, tokens=(2048, 8192, 32768))
QUICK = dict(D=64, F=128, E=8, K=2, R=4, tokens=(256,))
D, F, E, K = (FULL[k] for k in "DFEK")


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
    layer = me.MoELayer(cfg, key=jr.key(0))
    if bias is not None:
        layer = eqx.tree_at(lambda l: l.router.bias, layer, bias)
    return eqx.partition(layer, eqx.is_inexact_array)


def fns(static, mesh):
    def fwd(p, x):
        return eqx.combine(p, static)(x, mesh=mesh)[0]

    def step(p, x):
        def loss(p):
            y, stats = eqx.combine(p, static)(x, mesh=mesh)
            return jnp.sum(y * y), stats

        return jax.grad(loss, has_aux=True)(p)

    return fwd, step


def compiled(fn, params, x):
    return jax.jit(fn).lower(params, x).compile()


def memory_of(exe) -> dict:
    ma = exe.memory_analysis()
    temp, out = ma.temp_size_in_bytes, ma.output_size_in_bytes
    return {
        "temp_mib": temp / 2**20,
        "output_mib": out / 2**20,
        "peak_mib": (temp + out) / 2**20,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    global D, F, E, K
    shape = QUICK if args.quick else FULL
    D, F, E, K = (shape[k] for k in "DFEK")
    devices = jax.devices()[: shape["R"]]
    mesh = jax.make_mesh((shape["R"],), ("expert",), devices=devices)
    token_counts = shape["tokens"]
    passes = ("fwd+bwd",) if args.quick else ("forward", "fwd+bwd")
    rows, exes = [], {}
    for t in token_counts:
        x = jnp.zeros((t, D), jnp.float32)
        variants = {
            "capped-only": make(2.0, "drop"),
            "capped+fallback": make(2.0, "fallback"),
        }
        if not args.quick:
            variants["worst-case"] = make(None, "fallback")
        for label in passes:
            res = {}
            for name, (params, static) in variants.items():
                fwd, step = fns(static, mesh)
                exe = compiled(fwd if label == "forward" else step, params, x)
                exes[t, label, name] = exe  # reused for the timings below
                res[name] = memory_of(exe)
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
    print(
        f"Compiled per-device memory, EP{shape['R']}, d_model={D}, d_ff={F}, E={E}, k={K}"
    )
    print_table(
        rows,
        ["tokens", "pass_", "layer", "temp_mib", "output_mib", "peak_mib", "vs_capped"],
    )
    t = token_counts[0] if args.quick else 8192
    timing = step_times(t, passes, exes, repeats=3 if args.quick else 10)
    print(
        f"\nStep time, EP{shape['R']}, {t} tokens: the default layer (capped + fallback) against"
        " the capped-only layer (on_overflow='drop'), interleaved, min over repeats"
    )
    print_table(
        timing,
        [
            "routing",
            "pass_",
            "layer",
            "ms",
            "vs_capped",
            "overflow",
            "fallback_used",
            "num_chunks",
            "dropped_pairs",
        ],
    )
    write_json("fallback", {"memory": rows, "timing": timing, "quick": args.quick})


def step_times(t, passes, exes, repeats):
    """The price of the fallback when it does not run (uniform routing), and its cost
    when it runs (every token prefers shard 0's experts, so the 2x buffer overflows)."""
    x = jr.normal(jr.key(1), (t, D), jnp.float32)
    hot = jnp.zeros((E,), jnp.float32).at[: E // 8].set(5.0)
    timing = []
    for routing, bias in (("no overflow", jnp.zeros((E,))), ("overflow", hot)):
        for label in passes:
            cands = {}
            for name, oo in (("capped-only", "drop"), ("capped+fallback", "fallback")):
                params, _ = make(2.0, oo, bias)
                cands[name] = (exes[t, label, name], (params, x))
            best = interleaved_min(cands, repeats)
            for name, (exe, a) in cands.items():
                row = dict(
                    routing=routing,
                    pass_=label,
                    layer=name,
                    ms=1e3 * best[name],
                    vs_capped=best[name] / best["capped-only"],
                )
                if label == "fwd+bwd":
                    stats = exe(*a)[1]
                    row.update(
                        overflow=bool(stats.overflow),
                        fallback_used=bool(stats.fallback_used),
                        num_chunks=int(stats.num_chunks),
                        dropped_pairs=int(stats.dropped_pairs),
                    )
                timing.append(row)
    return timing


if __name__ == "__main__":
    main()
