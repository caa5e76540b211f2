"""Experts split over the data axis too (`MoEConfig.fsdp_axes`): per-device memory.

Measured: one Adam training step of a stack of MoE layers on a 2 (data) x 4 (expert)
mesh of CPU devices, compiled with the experts replicated over `data` (the baseline)
and split over it, from the compiled program's `memory_analysis()` per device:

- `params+adam`: the bytes of the step's parameter and optimizer-state arguments
  (`argument_size_in_bytes` less the batch); goal: halved.
- `peak`: arguments + temporaries + outputs (nothing donated). The layers are stacked
  and applied with `lax.scan`, each under `jax.checkpoint` (rematerialised in the
  backward pass, as large models are trained), so the backward pass gathers a
  layer's experts again rather than keeping every layer's; goal: the temporaries
  grow by no more than one layer's gathered experts (printed).

Also checks that the two steps return the same loss and updated weights, and counts
the reduce-scatters and all-reduces in the optimized program.

Then, computed from shapes (no run): what one device holds of the routed experts at
DeepSeek-V3 and Qwen3-235B-A22B sizes at EP8 / EP64, replicated over 8 data-parallel
groups or split over them: bf16 weights, and weights + float32 master copy + Adam's two
float32 moments (14 bytes per parameter).

    python benchmarks/fsdp.py [--layers 4] [--tokens 512]
"""

import argparse
import dataclasses
import re
import sys

from _common import print_table, setup_devices, write_json

setup_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import moe_eqx as me  # noqa: E402

MIB = 2**20


def _model(cfg, layers, key):
    # Layers stacked along a leading axis, applied with `lax.scan`.
    return eqx.filter_vmap(lambda k: me.MoELayer(cfg, key=k))(jr.split(key, layers))


def _step(mesh, opt):
    def loss(params, x):
        dynamic, static = eqx.partition(params, eqx.is_array)

        # Each layer rematerialised in the backward pass (`jax.checkpoint`), as
        # large models are trained: the backward pass gathers a layer's experts
        # again instead of keeping every layer's.
        @jax.checkpoint
        def layer(x, arrays):
            y, _ = eqx.combine(arrays, static)(x, mesh=mesh)
            return x + y, None

        x, _ = jax.lax.scan(layer, x, dynamic)
        return jnp.mean(jnp.square(x))

    def step(params, opt_state, x):
        value, grads = eqx.filter_value_and_grad(loss)(params, x)
        updates, opt_state = opt.update(
            grads, opt_state, eqx.filter(params, eqx.is_inexact_array)
        )
        return value, eqx.apply_updates(params, updates), opt_state

    return jax.jit(step)


def measure(cfg, layers, tokens, mesh, key):
    opt = optax.adam(1e-2)
    params = me.shard_model(_model(cfg, layers, key), mesh)
    opt_state = me.shard_model(opt.init(eqx.filter(params, eqx.is_inexact_array)), mesh)
    x = jax.device_put(
        jr.normal(jr.key(1), (tokens, cfg.d_model)),
        NamedSharding(mesh, P(tuple(mesh.axis_names))),
    )
    step = _step(mesh, opt)
    compiled = step.lower(params, opt_state, x).compile()
    ma = compiled.memory_analysis()
    batch = x.nbytes / mesh.size
    hlo = compiled.as_text()
    value, new, _ = step(params, opt_state, x)
    return {
        "params+adam_mib": (ma.argument_size_in_bytes - batch) / MIB,
        "temp_mib": ma.temp_size_in_bytes / MIB,
        "peak_mib": (
            ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
        )
        / MIB,
        "reduce_scatters": len(re.findall(r"= \S+ reduce-scatter\(", hlo)),
        "all_reduces": len(re.findall(r"= \S+ all-reduce\(", hlo)),
        "_loss": float(value),
        "_weights": np.asarray(new.experts.w_down),
    }


# (name, experts, d_model, expert d_ff, MoE layers)
MODELS = [
    ("DeepSeek-V3", 256, 7168, 2048, 58),
    ("Qwen3-235B-A22B", 128, 4096, 1536, 94),
]


def sizes_table(data: int = 8) -> list[dict]:
    rows = []
    for name, e, h, f, n in MODELS:
        params = e * h * f * 3 * n  # gate, up, down
        for ep in (8, 64):
            for fsdp in (False, True):
                per_device = params / ep / (data if fsdp else 1)
                if fsdp:
                    split = "experts" if (e // ep) % data == 0 else "d_ff"
                else:
                    split = "-"
                rows.append(
                    {
                        "model": name,
                        "EP": ep,
                        "data": data,
                        "fsdp": fsdp,
                        "split": split,
                        "bf16_GB": per_device * 2 / 1e9,
                        "with_adam_GB": per_device * 14 / 1e9,
                    }
                )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    args = p.parse_args(argv)
    mesh = jax.make_mesh(
        (2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    cfg = me.MoEConfig(
        d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts, top_k=2
    )
    layer_mib = 3 * args.experts * args.d_model * args.d_ff * 4 / MIB
    rows = []
    for fsdp_axes in ((), ("data",)):
        c = dataclasses.replace(cfg, fsdp_axes=fsdp_axes)
        r = measure(c, args.layers, args.tokens, mesh, jr.key(0))
        rows.append({"experts": "split over data" if fsdp_axes else "replicated", **r})
    base, split = rows
    np.testing.assert_allclose(split["_loss"], base["_loss"], rtol=1e-5)
    np.testing.assert_allclose(
        split["_weights"], base["_weights"], rtol=1e-5, atol=1e-6
    )
    for r in rows:
        r["params+adam_ratio"] = r["params+adam_mib"] / base["params+adam_mib"]
        r["peak_ratio"] = r["peak_mib"] / base["peak_mib"]
        del r["_loss"], r["_weights"]
    growth = split["temp_mib"] - base["temp_mib"]
    gathered = layer_mib / 4  # one layer's experts of one expert shard
    print(
        f"Adam step, {args.layers} MoE layers (E={args.experts}, d_model="
        f"{args.d_model}, d_ff={args.d_ff}, float32), {args.tokens} tokens, "
        "2 (data) x 4 (expert) CPU mesh, per device:\n"
    )
    cols = ["experts", "params+adam_mib", "params+adam_ratio", "temp_mib", "peak_mib"]
    cols += ["peak_ratio", "reduce_scatters", "all_reduces"]
    print_table(rows, cols)
    print(
        f"\ntemp growth: {growth:.2f} MiB = {growth / gathered:.2f} x one layer's "
        f"gathered experts ({gathered:.2f} MiB); {args.layers} layers."
    )
    table = sizes_table()
    print("\nRouted experts per device, from shapes (8 data-parallel groups):\n")
    print_table(
        table, ["model", "EP", "data", "fsdp", "split", "bf16_GB", "with_adam_GB"]
    )
    write_json(
        "fsdp",
        {
            "config": vars(args),
            "rows": rows,
            "temp_growth_mib": growth,
            "gathered_layer_mib": gathered,
            "sizes": table,
        },
    )
    # Only the router (replicated) is not halved.
    if split["params+adam_ratio"] > 0.51 or growth > gathered:
        sys.exit(
            "FAILED: the state is not halved, or the peak grew by more than a layer"
        )


if __name__ == "__main__":
    main()
