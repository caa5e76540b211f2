"""Compile time of the layer against a minimal MoE, in one process.

    python3 benchmarks/compile.py              # every row, min of 5 compilations each
    python3 benchmarks/compile.py --quick      # one device and EP8 drop, one try each

Each row is the wall time of `jax.jit(f).lower(*args).compile()` (tracing and lowering
included) of a forward+backward step: `jax.value_and_grad` of a scalar loss of the
output with respect to every floating-point parameter. The baseline of each row is a
minimal MoE written below for the comparison: softmax top-k routing, `argsort`,
`jnp.bincount`, two `lax.ragged_dot`s and a scatter-add on one device; for EP8, the
same inside `shard_map` with a capped dense `all_to_all` of `[R, C, d]` blocks per
destination (no deduplication, no overflow check, no fallback, pairs past the
capacity dropped). Every measurement starts from empty jax caches
(`jax.clear_caches()`), and the baseline and the layer alternate, so both see the
same load of a shared machine; the row's ratio is the layer's best time over the
baseline's best time.

Rows (T=1024 tokens, d_model=64, d_ff=128, E=16, top-2; EP over 8 simulated CPU
devices):

- `one device`: `layer(x)`.
- `EP8 drop`: `on_overflow="drop"`.
- `EP8 fallback`: `on_overflow="fallback"` (the default): the exact overflow
    predicate and the chunked dropless fallback compiled in.
- `EP8 fallback + 1 slot`: and one duplication slot per shard (the planner, the
    slot weights' exchange).
- `demo --ep 8 step`: the training step of `python3 -m moe_eqx.demo --ep 8` (a
    2-layer transformer LM with these layers as FFNs, AdamW; its MoE layers have one
    slot), against the same model and step with the minimal EP MoE as FFN.

`ratio` is the wall-time ratio (the goal's measure); `cpu_ratio` the ratio of process
CPU times, steadier where other work shares the cores. Goal: every ratio <= 2.0. Writes benchmarks/results/compile.json.
"""

import argparse
import functools as ft
import os
import platform
import sys
import time

from _common import print_table, setup_devices, write_json

setup_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_eqx as me  # noqa: E402

T, D, F, E, K = 1024, 64, 128, 16, 2


# ---------------------------------------------------------------------------------
# The minimal MoE.


def minimal_params(key, d_model, d_ff, num_experts):
    k1, k2, k3 = jr.split(key, 3)
    return {
        "router": jr.normal(k1, (d_model, num_experts)) / d_model**0.5,
        "w_gate_up": jr.normal(k2, (num_experts, d_model, 2 * d_ff)) / d_model**0.5,
        "w_down": jr.normal(k3, (num_experts, d_ff, d_model)) / d_ff**0.5,
    }


def _route(p, x, k):
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    return weights / jnp.sum(weights, axis=-1, keepdims=True), experts


def _ffn(xs, p, sizes):
    d_ff = p["w_down"].shape[1]
    h = jax.lax.ragged_dot(xs, p["w_gate_up"], sizes)
    return jax.lax.ragged_dot(
        jax.nn.silu(h[:, :d_ff]) * h[:, d_ff:], p["w_down"], sizes
    )


def minimal_one_device(p, x, k):
    """Top-k routing, one sort, two ragged_dots, a scatter-add back to the tokens."""
    weights, experts = _route(p, x, k)
    flat = experts.ravel()
    order = jnp.argsort(flat)
    sizes = jnp.bincount(flat, length=p["router"].shape[1]).astype(jnp.int32)
    out = _ffn(x[order // k], p, sizes)
    contrib = out * weights.ravel()[order][:, None]
    return jnp.zeros_like(x).at[order // k].add(contrib)


def _minimal_shard(p, x, k, num_shards, capacity, axis):
    tokens, d = x.shape
    local = p["w_gate_up"].shape[0]
    weights, experts = _route(p, x, k)
    order = jnp.argsort(experts.ravel())
    e_sorted = experts.ravel()[order]
    dest = e_sorted // local
    counts = jnp.bincount(dest, length=num_shards)
    pos = jnp.arange(tokens * k) - (jnp.cumsum(counts) - counts)[dest]
    keep = pos < capacity
    slot = jnp.where(keep, dest * capacity + pos, num_shards * capacity)
    rows = num_shards * capacity
    send = jnp.zeros((rows, d), x.dtype).at[slot].set(x[order // k], mode="drop")
    send_e = (
        jnp.full((rows,), local, jnp.int32).at[slot].set(e_sorted % local, mode="drop")
    )
    recv = jax.lax.all_to_all(send.reshape(num_shards, capacity, d), axis, 0, 0)
    recv_e = jax.lax.all_to_all(send_e.reshape(num_shards, capacity), axis, 0, 0)
    recv, recv_e = recv.reshape(rows, d), recv_e.reshape(rows)
    o2 = jnp.argsort(recv_e)
    sizes = jnp.bincount(recv_e, length=local + 1)[:local].astype(jnp.int32)
    out = _ffn(recv[o2], p, sizes)
    back = jnp.zeros_like(out).at[o2].set(out).reshape(num_shards, capacity, d)
    back = jax.lax.all_to_all(back, axis, 0, 0).reshape(rows, d)
    contrib = back.at[slot].get(mode="fill", fill_value=0)
    contrib = contrib * (weights.ravel()[order] * keep)[:, None]
    return jnp.zeros_like(x).at[order // k].add(contrib)


def minimal_ep(p, x, k, mesh, capacity_factor=2.0, axis="expert"):
    """The capped expert-parallel MoE: `[R, C, d]` blocks through `all_to_all`."""
    num_shards = mesh.shape[axis]
    tokens = x.shape[0] // mesh.size
    capacity = max(1, int(capacity_factor * tokens * k / num_shards))
    body = ft.partial(
        _minimal_shard, k=k, num_shards=num_shards, capacity=capacity, axis=axis
    )
    specs = {"router": P(), "w_gate_up": P(axis), "w_down": P(axis)}
    tokens_spec = P(tuple(mesh.axis_names))
    return jax.shard_map(
        body, mesh=mesh, in_specs=(specs, tokens_spec), out_specs=tokens_spec
    )(p, x)


# ---------------------------------------------------------------------------------
# Programs to compile: `(fn, args)`, `fn` jitted fresh for each measurement.


def _loss_of(y):
    return jnp.sum(jnp.square(y.astype(jnp.float32)))


def layer_program(config, mesh):
    layer = me.MoELayer(config, key=jr.key(0))
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    x = jr.normal(jr.key(1), (T, D))

    def step(params, x):
        y, stats = eqx.combine(params, static)(x, mesh=mesh)
        return _loss_of(y), stats

    return jax.value_and_grad(step, argnums=(0, 1), has_aux=True), (params, x)


def minimal_program(mesh):
    p = minimal_params(jr.key(0), D, F, E)
    x = jr.normal(jr.key(1), (T, D))
    if mesh is None:
        fn = lambda p, x: _loss_of(minimal_one_device(p, x, K))  # noqa: E731
    else:
        fn = lambda p, x: _loss_of(minimal_ep(p, x, K, mesh))  # noqa: E731
    return jax.value_and_grad(fn, argnums=(0, 1)), (p, x)


class MinimalMoE(eqx.Module):
    """The minimal EP MoE as a drop-in for the demo's layer: `(y, stats)`, with the
    stats the training step reads filled from the minimal routing (no fallback, no
    planning)."""

    params: dict
    config: me.MoEConfig = eqx.field(static=True)

    def __call__(self, x, *, mesh):
        cfg = self.config
        y = minimal_ep(self.params, x, cfg.top_k, mesh)
        zero = jnp.zeros((), jnp.int32)
        shards = jnp.zeros((mesh.shape[cfg.axis_name],), jnp.int32)
        stats = me.MoEStats(
            overflow=jnp.array(False),
            fallback_used=jnp.array(False),
            dropped_pairs=zero,
            lost_pairs=zero,
            recv_pairs=shards,
            wire_rows=shards,
            max_over_mean=jnp.array(1.0),
            max_over_mean_before=jnp.array(1.0),
            load_balance_loss=jnp.array(1.0),
            router_z_loss=jnp.array(0.0),
            required_buffer_factor=jnp.array(0.0),
            dedup_ratio=jnp.array(1.0),
            num_chunks=jnp.array(1, jnp.int32),
            block_rows=zero,
            expert_counts=jnp.ones((cfg.num_experts,), jnp.int32),
            nan_tokens=zero,
        )
        return y, stats


def demo_program(minimal: bool):
    from moe_eqx.train import cli, step

    args = cli.build_parser().parse_args(["--ep", "8"])
    config = cli.check_args(cli.build_parser(), args)
    mesh = model_mesh()
    from moe_eqx.train.model import model_from_args

    model = model_from_args(args, config, key=jr.key(0))
    if minimal:
        keys = jr.split(jr.key(2), args.layers)
        params = jax.vmap(
            lambda k: minimal_params(k, config.d_model, config.d_ff, config.num_experts)
        )(keys)
        moe = MinimalMoE(params, config)
        model = eqx.tree_at(lambda m: m.blocks.moe, model, moe)
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.adamw(1e-3)
    loss_fn = step.make_loss_fn(static, mesh, lb_coef=0.01, z_coef=1e-3, strict=False)
    if minimal:
        # The minimal layer has no router bias to set.
        loss_fn = _without_bias(loss_fn, static)
    opt_state = optimizer.init(step.trainable(params))
    batch = jnp.zeros((args.batch, args.seq + 1), jnp.int32)
    bias = jnp.zeros((config.num_experts,), jnp.float32)

    def train_step(params, opt_state, key, batch, bias):
        weights, fixed = eqx.partition(params, eqx.is_inexact_array)
        grads, metrics = jax.grad(
            lambda w: loss_fn(eqx.combine(w, fixed), batch, bias, key), has_aux=True
        )(weights)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return eqx.apply_updates(weights, updates), opt_state, metrics

    return train_step, (params, opt_state, jr.key(3), batch, bias)


def _without_bias(loss_fn, static):
    from moe_eqx.train import step

    def fn(params, batch, router_bias, key):
        model = eqx.combine(params, static)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits, stats = model(inputs, mesh=model_mesh(), key=key)
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
        lb, z = jnp.mean(stats.load_balance_loss), jnp.mean(stats.router_z_loss)
        return ce, step.step_metrics(ce, ce, lb, z, stats)

    return fn


@ft.cache
def model_mesh():
    auto = (jax.sharding.AxisType.Auto,)
    return jax.make_mesh((8,), ("expert",), axis_types=auto, devices=jax.devices()[:8])


def compile_seconds(make) -> tuple[float, float]:
    """Seconds to trace, lower and compile `make()`'s program from empty caches: wall
    time and this process's CPU time (all threads)."""
    jax.clear_caches()
    fn, args = make()
    start, cpu = time.perf_counter(), time.process_time()
    jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="tries per program")
    parser.add_argument("--quick", action="store_true", help="two rows, one try")
    parser.add_argument("--out", default=None, help="JSON path (default: results/)")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    mesh = model_mesh()
    base = dict(d_model=D, d_ff=F, num_experts=E, top_k=K)
    rows = [
        ("one device", lambda: layer_program(me.MoEConfig(**base), None), None),
        (
            "EP8 drop",
            lambda: layer_program(me.MoEConfig(**base, on_overflow="drop"), mesh),
            mesh,
        ),
        ("EP8 fallback", lambda: layer_program(me.MoEConfig(**base), mesh), mesh),
        (
            "EP8 fallback + 1 slot",
            lambda: layer_program(me.MoEConfig(**base, num_slots=1), mesh),
            mesh,
        ),
        ("demo --ep 8 step", lambda: demo_program(False), "demo"),
    ]
    if args.quick:
        rows = rows[:2]
    results = []
    for name, make, which in rows:
        if which == "demo":
            make_base = lambda: demo_program(True)  # noqa: E731
        else:
            make_base = ft.partial(minimal_program, which)
        ours, baseline = [], []
        for _ in range(repeats):
            baseline.append(compile_seconds(make_base))
            ours.append(compile_seconds(make))
        wall, cpu = (
            min(t[i] for t in ours) / min(t[i] for t in baseline) for i in (0, 1)
        )
        row = {
            "program": name,
            "moe_eqx_s": min(t[0] for t in ours),
            "minimal_s": min(t[0] for t in baseline),
            "ratio": wall,
            "cpu_ratio": cpu,
            "goal": "<= 2.0",
        }
        row["met"] = row["ratio"] <= 2.0
        results.append(row)
        print(
            f"{name}: {row['moe_eqx_s']:.2f} s vs {row['minimal_s']:.2f} s", flush=True
        )
    print()
    columns = ["program", "moe_eqx_s", "minimal_s", "ratio", "cpu_ratio", "goal", "met"]
    print_table(results, columns)
    payload = {
        "shapes": dict(tokens=T, d_model=D, d_ff=F, experts=E, top_k=K),
        "repeats": repeats,
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "rows": results,
    }
    if args.out:
        import json
        import pathlib

        pathlib.Path(args.out).write_text(json.dumps(payload, indent=2))
    else:
        write_json("compile", payload)
    return payload


if __name__ == "__main__":
    main()
