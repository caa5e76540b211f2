"""The whole MoE layer against dense matmuls of the same expert FLOPs.

    python3 benchmarks/layer.py            # T=4096, d_model=512, d_ff=256, E=32, k=4
    python3 benchmarks/layer.py --quick    # tiny smoke run (seconds)
    python3 benchmarks/layer.py --gpu      # one GPU, bfloat16 (benchmarks/gpu_check.sh)

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
  Needs `torch` and `transformers` (not dependencies of moe_eqx); without them the
  rows say so and are skipped.

Prints a table and writes benchmarks/results/layer.json (`--gpu`: layer_gpu.json).
"""

import argparse
import os
import platform
import sys

from _common import interleaved_min, print_table, setup_devices, write_json

if "--gpu" not in sys.argv:
    setup_devices(8)

import equinox as eqx  # noqa: E402
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


def layer_fns(layer, x, mesh):
    """The layer's forward and fwd+bwd (all float parameters and `x`)."""
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def fwd(p, x):
        return eqx.combine(p, static)(x, mesh=mesh)

    def step(p, x):
        def loss(p, x):
            y, stats = eqx.combine(p, static)(x, mesh=mesh)
            return jnp.sum(jnp.square(y.astype(jnp.float32))), stats

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(p, x)

    return (jax.jit(fwd), (params, x)), (jax.jit(step), (params, x))


def make_layer(shape, dtype, **overrides):
    t, d, f, e, k = shape
    cfg = me.MoEConfig(d_model=d, d_ff=f, num_experts=e, top_k=k, **overrides)
    return me.MoELayer(cfg, key=jr.PRNGKey(0), dtype=dtype)


def variants(shape, dtype, num_devices, quick):
    """`name -> (layer, mesh)`."""
    out = {"one device": (make_layer(shape, dtype), None)}
    if num_devices < 1:
        return out
    mesh = jax.make_mesh((num_devices,), ("expert",))
    ep = f"EP{num_devices}"
    slot_options = (0,) if (quick or num_devices == 1) else (0, 2)
    for on_overflow in ("drop", "fallback"):
        for slots in slot_options:
            name = f"{ep} {on_overflow}" + (f" slots={slots}" if slots else "")
            layer = make_layer(shape, dtype, on_overflow=on_overflow, num_slots=slots)
            out[name] = (layer, mesh)
    return out


def check_no_overflow(name, fwd):
    fn, args = fwd
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
    state = {name: v.detach().numpy() for name, v in block.state_dict().items()}
    cfg = me.MoEConfig(d_model=d, d_ff=f, num_experts=e, top_k=k)
    ours = me.layer_from_hf_state_dict(cfg, state)
    xt = torch.tensor(np.asarray(x, np.float32))[None]
    y_hf = block(xt)
    y_hf = (y_hf[0] if isinstance(y_hf, tuple) else y_hf)[0].detach().numpy()
    err = float(np.max(np.abs(y_hf - np.asarray(ours(x)[0]))))

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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    p.add_argument("--gpu", action="store_true", help="one GPU, bfloat16")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-ep", action="store_true", help="one-device rows only")
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
    dense = dense_fns(dtype, t * k, d, f, jr.PRNGKey(1))
    x = jr.normal(jr.PRNGKey(2), (t, d), jnp.float32).astype(dtype)

    rows, one_device = [], {}
    for name, (layer, mesh) in variants(shape, dtype, num_devices, args.quick).items():
        fwd, step = layer_fns(layer, x, mesh)
        check_no_overflow(name, fwd)
        for label, fn, base in (
            ("forward", fwd, dense[0]),
            ("fwd+bwd", step, dense[1]),
        ):
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


if __name__ == "__main__":
    main()
