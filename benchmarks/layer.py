"""The whole MoE layer against dense matmuls of the same expert FLOPs.

    python3 benchmarks/layer.py            # T=4096, d_model=512, d_ff=256, E=32, k=4
    python3 benchmarks/layer.py --quick    # tiny smoke run (seconds): fwd+bwd only,
                                           # EP8 drop only, one GMM window size
    python3 benchmarks/layer.py --gpu      # one GPU, bfloat16 (benchmarks/gpu_check.sh)
    python3 benchmarks/layer.py --breakdown  # where the fwd+bwd step's time goes, by stage

Rows (every one jitted, timed in this process, min over repetitions run round-robin
with the baseline so that all see the same load; the CPU is shared):

- `dense`, the baseline: the SwiGLU FFN as three dense matmuls on `[T*k, d_model]` rows
  with one expert's weights, in the layer's dtype: `(silu(x @ Wg) * (x @ Wu)) @ Wd`
  (gate and up as one `[d_model, 2 d_ff]` product, as the layer does). Forward+backward
  is `jax.grad` of `sum(y**2)` with respect to the rows and both weight matrices. It
  has the layer's expert FLOPs and nothing else: no router, top-k, sort, gather of the
  rows, weighted combine (scatter-add), exchange, planning or fallback. Whatever those
  cost is in the ratio `vs_dense` (dense time / layer time: 1.0 = dense speed).
- `one device`: `layer(x)`; forward+backward is `jax.grad` of `sum(y**2)` with respect
  to all floating-point parameters and `x`.
- `EP8 ...`: the same global tokens over 8 simulated CPU devices sharing the same cores
  (the same total FLOPs), `on_overflow` "drop" or "fallback" (the fallback compiled in
  but not running: the routing does not overflow, asserted), duplication slots off or
  on (`num_slots=2`). `vs_one_device` is the one-device time over this row's time.
- `HF Qwen3-MoE (...)`: Hugging Face's `Qwen3MoeSparseMoeBlock` on the same shapes,
  with its weights loaded into the layer through `me.layer_from_hf_state_dict`, timed
  with torch on the same threads, once per experts implementation transformers offers.
  Needs `torch` and `transformers` (the `hf` extra, not dependencies of moe_eqx);
  without them the rows say so and are skipped.

Prints a table and writes benchmarks/results/layer.json (`--gpu`: layer_gpu.json).

`--breakdown` instead splits the forward+backward step of `one device`, `EP8 drop` and
`EP8 fallback` by stage (routing, planning, wire rows, exchange copies, expand_rows,
GMM, combine, scatter back to tokens, stats, ...): the step runs under `jax.profiler`,
every XLA:CPU thunk is attributed to a stage through the Python call stack recorded in
the compiled HLO (the named steps of `moe_eqx/_shard.py` and `moe_eqx/_trip.py`, else
the innermost `moe_eqx.*` named scope), forward or backward by its `transpose(...)`
name, and each stage gets its share of the thunk time times the step's interleaved min
time (so the stages sum to the step). Collectives are apart: with 8 simulated devices
on 2 cores, a device in a collective mostly waits for the others (asleep, leaving the
cores to them: 21 tiny all-gathers take 3.6 ms in all), so their row is the mean time
one device spends in them, not part of the total. Writes
benchmarks/results/layer_breakdown.json.
"""

import argparse
import os
import platform
import re
import sys

from _common import (
    hlo_instructions,
    interleaved_min,
    layer_fns,
    print_table,
    setup_devices,
    thunk_times,
    write_json,
)

if "--gpu" not in sys.argv:
    setup_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402

import moe_eqx as me  # noqa: E402


def dense_fns(dtype, rows, d_model, d_ff, key):
    """The baseline: one expert's SwiGLU on all `T*k` rows, forward and fwd+bwd."""
    k1, k2, k3 = jr.split(key, 3)
    x = jr.normal(k1, (rows, d_model), jnp.float32).astype(dtype)
    w_gu = (jr.normal(k2, (d_model, 2 * d_ff), jnp.float32) / d_model**0.5).astype(
        dtype
    )
    w_dn = (jr.normal(k3, (d_ff, d_model), jnp.float32) / d_ff**0.5).astype(dtype)

    def ffn(x, w_gu, w_dn):
        gu = x @ w_gu
        act = jax.nn.silu(gu[:, :d_ff].astype(jnp.float32)) * gu[:, d_ff:]
        return act.astype(dtype) @ w_dn

    def loss(x, w_gu, w_dn):
        return jnp.sum(jnp.square(ffn(x, w_gu, w_dn).astype(jnp.float32)))

    args = (x, w_gu, w_dn)
    return (jax.jit(ffn), args), (jax.jit(jax.grad(loss, argnums=(0, 1, 2))), args)


def make_layer(shape, dtype, quick=False, **overrides):
    del quick  # the same layer: the tiled GMM compiles one window size anyway
    t, d, f, e, k = shape
    cfg = me.MoEConfig(d_model=d, d_ff=f, num_experts=e, top_k=k, **overrides)
    return me.MoELayer(cfg, key=jr.key(0), dtype=dtype)


def variants(shape, dtype, num_devices, quick):
    """`name -> (layer, mesh)`."""
    out = {"one device": (make_layer(shape, dtype, quick), None)}
    if num_devices < 1:
        return out
    mesh = jax.make_mesh((num_devices,), ("expert",))
    ep = f"EP{num_devices}"
    slot_options = (0,) if (quick or num_devices == 1) else (0, 2)
    # Quick: one EP program (each takes seconds to compile), the capped path.
    for on_overflow in ("drop",) if quick else ("drop", "fallback"):
        for slots in slot_options:
            name = f"{ep} {on_overflow}" + (f" slots={slots}" if slots else "")
            layer = make_layer(
                shape, dtype, quick, on_overflow=on_overflow, num_slots=slots
            )
            out[name] = (layer, mesh)
            if on_overflow == "fallback" and not slots:
                # Token chunks (`token_chunks=2`): on one device or a CPU nothing
                # overlaps, so this row is their cost; on several GPUs, their gain.
                chunked = make_layer(shape, dtype, quick, token_chunks=2)
                out[f"{name} token_chunks=2"] = (chunked, mesh)
    return out


def check_no_overflow(name, call):
    """Raises if `call` (a forward or a fwd+bwd step: its output 1 is the stats)
    overflowed or lost pairs."""
    fn, args = call
    stats = fn(*args)[1]
    if bool(stats.overflow) or int(stats.lost_pairs) != 0:
        raise RuntimeError(f"{name}: the routing overflowed or lost pairs: {stats}")


def hf_rows(shape, x, dense, repeats):
    """Hugging Face's Qwen3-MoE block on the same shapes and weights, per experts
    implementation; `[]` and a note when torch/transformers are missing."""
    try:
        import torch
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock,
        )
    except ImportError as e:
        return [], f"skipped: torch/transformers not installed ({e.name})"
    t, d, f, e, k = shape
    rows = []
    for impl in ("grouped_mm", "eager"):
        cfg = Qwen3MoeConfig(
            hidden_size=d,
            moe_intermediate_size=f,
            num_experts=e,
            num_experts_per_tok=k,
            norm_topk_prob=True,
        )
        if impl != "eager" and not hasattr(cfg, "_experts_implementation"):
            continue  # this transformers has only the eager loop
        if hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = impl
        try:
            rows.extend(
                _time_hf(
                    Qwen3MoeSparseMoeBlock(cfg), impl, shape, x, dense, repeats, torch
                )
            )
        except Exception as err:  # report, do not hide, an implementation that fails
            rows.append(dict(layer=f"HF Qwen3-MoE ({impl})", note=repr(err)[:80]))
    return rows, f"torch {torch.__version__}, {torch.get_num_threads()} threads"


def _time_hf(block, impl, shape, x, dense, repeats, torch):
    t, d, f, e, k = shape
    block = block.float().eval()
    # transformers leaves the block's parameters uninitialised (torch.empty: NaNs and
    # garbage) until a model's `_init_weights` runs: draw them here, scaled by fan-in
    # (the last axis of every one of its `[..., out, in]` weights).
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(
                torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5
            )
    state = {name: v.detach().numpy() for name, v in block.state_dict().items()}
    cfg = me.MoEConfig(d_model=d, d_ff=f, num_experts=e, top_k=k)
    ours = me.layer_from_hf_state_dict(cfg, state)
    xt = torch.tensor(np.asarray(x, np.float32))[None]
    y_hf = block(xt)
    y_hf = (y_hf[0] if isinstance(y_hf, tuple) else y_hf)[0].detach().numpy()
    err = float(np.max(np.abs(y_hf - np.asarray(ours(x)[0]))))
    if not err < 1e-3 * max(1.0, float(np.max(np.abs(y_hf)))):
        raise RuntimeError(f"the HF block and ours differ: max |y - ours| = {err:.1e}")

    class Fn:
        def __init__(self, backward):
            self.backward = backward

        def __call__(self):
            xg = xt.clone().requires_grad_(self.backward)
            with torch.set_grad_enabled(self.backward):
                out = block(xg)
                out = out[0] if isinstance(out, tuple) else out
                if self.backward:
                    out.square().sum().backward()
            return jnp.zeros(())  # something to block on

    rows = []
    for label, back, base in (
        ("forward", False, dense[0]),
        ("fwd+bwd", True, dense[1]),
    ):
        best = interleaved_min({"hf": (Fn(back), ()), "dense": base}, repeats)
        rows.append(
            dict(
                layer=f"HF Qwen3-MoE ({impl})",
                pass_=label,
                ms=1e3 * best["hf"],
                dense_ms=1e3 * best["dense"],
                vs_dense=best["dense"] / best["hf"],
                note=f"max |y - ours| {err:.1e}",
            )
        )
    return rows


# Stages of `--breakdown`: an instruction belongs to the first stage (in this order)
# whose opcodes match, else to the stage of the innermost function of its Python call
# stack named here. Collectives first: wherever they are called from, they are
# collectives (including the time a device waits for the others in them).
COLLECTIVES = frozenset(
    {"all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter"}
)
STAGE_FUNCTIONS = {
    "routing": {"_route", "Router.__call__", "physical_routing"},
    "planning": {
        "_destinations",
        "plan_duplication",
        "assign_destinations",
        "make_exchange_plan",
        "_unsent_pairs",
        "overflow_predicate",
        "fallback_chunking",
    },
    "sort by expert": {"sort_by_expert"},
    "dedup/wire rows": {"dedup_rows", "send_counts"},
    "exchange copies": {
        "DenseExchange.dispatch_unpacked",
        "DenseExchange.combine_unpacked",
        "DenseExchange.dispatch",
        "DenseExchange.combine",
        "RaggedExchange.dispatch",
        "RaggedExchange.combine",
        "_Route.move",
    },
    "expand_rows": {"expand_rows"},
    "row gathers": {"send_rows", "_send", "_send_rows"},
    "GMM": {"expert_ffn", "Experts.__call__", "tiled_ffn"},
    "combine": {"combine"},
    "scatter back to tokens": {"scatter_to_tokens", "return_rows", "_return"},
    "stats": {"_stats", "routed_stats"},
    # The fallback's own work (piece masks, its loops, summing the pieces); the trips
    # it runs are counted in their stages above.
    "fallback (loop)": {"_loop", "_piece", "_piece_pullback", "chunked_dropless"},
}
# Gathers that several stages call (functions, then named scopes): theirs where a
# stage above calls them.
HELPERS = {
    "permute_rows": "row gathers",
    "unpermute_sum": "combine",
    "sum_rows": "scatter back to tokens",
}
HELPER_SCOPES = {"moe_eqx.permute": "row gathers", "moe_eqx.unpermute": "combine"}
# Where a custom_vjp or a nested jit cut the recorded call stack short: the innermost
# `moe_eqx.*` named scope of the instruction's name.
STAGE_SCOPES = {
    "moe_eqx.router": "routing",
    "moe_eqx.dispatch": "sort by expert",
    "moe_eqx.dedup_dispatch": "dedup/wire rows",
    "moe_eqx.exchange": "exchange copies",
    "moe_eqx.expand": "expand_rows",
    "moe_eqx.experts": "GMM",
    "moe_eqx.gmm": "GMM",
    "moe_eqx.combine": "combine",
    "moe_eqx.to_tokens": "scatter back to tokens",
    "moe_eqx.overflow": "planning",
    "moe_eqx.fallback": "fallback (loop)",
}
# Leftovers: the glue of the trip (row gathers written inline) and of the layer.
GLUE = {
    "expert_parallel_trip": "row gathers",
    "_single_device_call": "row gathers",
}


def stage_of(opcode: str, op_name: str, functions: tuple[str, ...]) -> str:
    if opcode in COLLECTIVES:
        return "collectives"
    by_function = {f: stage for stage, fs in STAGE_FUNCTIONS.items() for f in fs}
    for table in (by_function, HELPERS):
        for function in functions:
            if function in table:
                return table[function]
    for table in (STAGE_SCOPES, HELPER_SCOPES):
        scopes = [p for p in re.split(r"[/()]", op_name) if p in table]
        if scopes:
            return table[scopes[-1]]
    for function in functions:
        if function in GLUE:
            return GLUE[function]
    return "other (layer glue, copies)"


def breakdown(step, wall_ms: float, repeats: int, num_devices: int) -> dict:
    """`stage -> {"fwd": ms, "bwd": ms}` of one jitted fwd+bwd step: each stage's
    share of the non-collective thunk time times `wall_ms` (see the module docstring);
    `collectives` is the mean time one device spends in them (not in the total)."""
    fn, args = step
    instructions = hlo_instructions(fn.lower(*args).compile().as_text())
    times, _ = thunk_times(fn, args, repeats)
    device_ms: dict = {}
    for name, ms in times.items():
        if name not in instructions:
            continue  # executor bookkeeping, not an instruction
        # A loop's or conditional's own event is its control (its body's thunks are
        # recorded themselves): part of its stage, like any other thunk.
        opcode, op_name, functions = instructions[name]
        stage = stage_of(opcode, op_name, functions)
        part = "bwd" if "transpose(" in op_name else "fwd"
        device_ms.setdefault(stage, {"fwd": 0.0, "bwd": 0.0})[part] += ms
    compute = sum(
        v["fwd"] + v["bwd"] for k, v in device_ms.items() if k != "collectives"
    )
    return {
        stage: {
            part: ms / num_devices if stage == "collectives" else wall_ms * ms / compute
            for part, ms in parts.items()
        }
        for stage, parts in device_ms.items()
    }


def run_breakdown(shape, dtype, x, repeats, quick):
    """The `--breakdown` table: one device, EP8 drop and EP8 fallback fwd+bwd steps
    (quick: no fallback)."""
    mesh = jax.make_mesh((len(jax.devices()),), ("expert",))
    ep = f"EP{len(jax.devices())}"
    steps = {}
    for name, mesh_, overrides in (
        ("one device", None, {}),
        (f"{ep} drop", mesh, dict(on_overflow="drop")),
        *(() if quick else ((f"{ep} fallback", mesh, dict(on_overflow="fallback")),)),
    ):
        layer = make_layer(shape, dtype, quick, **overrides)
        _, steps[name] = layer_fns(layer, x, mesh_)
        check_no_overflow(name, steps[name])
    wall = {k: 1e3 * v for k, v in interleaved_min(steps, repeats).items()}
    parts = {
        k: breakdown(step, wall[k], repeats, 1 if k == "one device" else mesh.size)
        for k, step in steps.items()
    }
    seen = {s for p in parts.values() for s in p} - {"collectives"}
    stages = [s for s in STAGE_FUNCTIONS if s in seen]
    stages += sorted(seen - set(stages))
    rows = []
    for stage in [*stages, "total", "collectives"]:
        row = {"stage": stage}
        for k, p in parts.items():
            fb = p.get(stage, {"fwd": 0.0, "bwd": 0.0})
            if stage == "total":
                fb = {
                    part: sum(v[part] for s, v in p.items() if s != "collectives")
                    for part in ("fwd", "bwd")
                }
            row[f"{k} fwd"], row[f"{k} bwd"] = fb["fwd"], fb["bwd"]
            row[k] = fb["fwd"] + fb["bwd"]
        names = list(parts)
        for k in names[1:]:
            row[f"{k} - one"] = row[k] - row[names[0]]
        rows.append(row)
    return rows, wall


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    p.add_argument("--gpu", action="store_true", help="one GPU, bfloat16")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-ep", action="store_true", help="one-device rows only")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="fwd+bwd step time by stage, one device vs EP (no other rows)",
    )
    args = p.parse_args(argv)

    dtype = jnp.bfloat16 if args.gpu else jnp.float32
    if args.quick:
        shape, repeats = (256, 64, 64, 8, 2), 3
    else:
        shape, repeats = (4096, 512, 256, 32, 4), 10
    if args.gpu:
        shape = (16384, 2048, 1024, 64, 8) if not args.quick else shape
    repeats = args.repeats or repeats
    t, d, f, e, k = shape
    num_devices = 0 if args.no_ep else len(jax.devices())
    dense = dense_fns(dtype, t * k, d, f, jr.key(1))
    x = jr.normal(jr.key(2), (t, d), jnp.float32).astype(dtype)
    if args.breakdown:
        return main_breakdown(shape, dtype, x, repeats, args.quick)

    rows, one_device = [], {}
    for name, (layer, mesh) in variants(shape, dtype, num_devices, args.quick).items():
        fwd, step = layer_fns(layer, x, mesh)
        # Quick: the fwd+bwd step only (one compilation per variant; its aux output
        # is the stats).
        check_no_overflow(name, step if args.quick else fwd)
        passes = (("forward", fwd, dense[0]), ("fwd+bwd", step, dense[1]))
        for label, fn, base in passes[1:] if args.quick else passes:
            best = interleaved_min({"layer": fn, "dense": base}, repeats)
            row = dict(
                layer=name,
                pass_=label,
                ms=1e3 * best["layer"],
                dense_ms=1e3 * best["dense"],
                vs_dense=best["dense"] / best["layer"],
            )
            if mesh is None:
                one_device[label] = best["layer"]
            else:
                row["vs_one_device"] = one_device[label] / best["layer"]
            rows.append(row)
            print_table([row], list(row))  # progress: one row at a time

    hf, hf_note = (
        ([], "skipped: --gpu") if args.gpu else hf_rows(shape, x, dense, repeats)
    )
    rows.extend(hf)
    print(
        f"\nMoE layer vs dense matmuls of the same expert FLOPs: T={t}, d_model={d}, "
        f"d_ff={f}, E={e}, k={k}, {jnp.dtype(dtype).name}, {jax.devices()[0].device_kind}"
    )
    print_table(
        rows, ["layer", "pass_", "ms", "dense_ms", "vs_dense", "vs_one_device", "note"]
    )
    print(f"Hugging Face Qwen3-MoE: {hf_note}")
    write_json(
        "layer_gpu" if args.gpu else "layer",
        {
            "shape": dict(
                T=t, d_model=d, d_ff=f, E=e, k=k, dtype=jnp.dtype(dtype).name
            ),
            "device": jax.devices()[0].device_kind,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "quick": args.quick,
            "repeats": repeats,
            "hf": hf_note,
            "rows": rows,
        },
    )
    return rows


def main_breakdown(shape, dtype, x, repeats, quick):
    t, d, f, e, k = shape
    rows, wall = run_breakdown(shape, dtype, x, repeats, quick)
    print(
        f"\nfwd+bwd step by stage (ms, share of thunk time x interleaved min step "
        f"time): T={t}, d_model={d}, d_ff={f}, E={e}, k={k}, "
        f"{jnp.dtype(dtype).name}, {jax.devices()[0].device_kind}"
    )
    names = list(wall)
    print_table(rows, ["stage", *names, *(f"{n} - one" for n in names[1:])])
    print("step ms: " + ", ".join(f"{n} {ms:.1f}" for n, ms in wall.items()))
    print(
        ", ".join(
            f"{n} / one device {wall[n] / wall[names[0]]:.2f}x" for n in names[1:]
        )
    )
    write_json(
        "layer_breakdown",
        {
            "shape": dict(
                T=t, d_model=d, d_ff=f, E=e, k=k, dtype=jnp.dtype(dtype).name
            ),
            "device": jax.devices()[0].device_kind,
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "quick": quick,
            "repeats": repeats,
            "step_ms": wall,
            "rows": rows,
        },
    )
    return rows


if __name__ == "__main__":
    main()
