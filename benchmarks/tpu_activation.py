"""The backward of the activation between the experts' two products on one TPU
chip: the ways the first product's cotangent can be formed.

    python3 benchmarks/tpu_activation.py --out activation_tpu.json [--shapes dsv2lite,qwen3]

The first product `h` is `[T k, 2 d_ff]` (`[gate | up]`, bfloat16), the activation
`moe_eqx.SwiGLU`, the cotangent of the hidden units `[T k, d_ff]`. Rows, each value
checked against the first row's:

- `XLA, halves`: JAX's vjp of each half, rounded, then concatenated (the library's
  way off the TPU);
- `XLA, one vjp`: `activation.vjp` of the whole of `h` in float32, rounded after the
  concatenation;
- `kernel`: `moe_eqx._gmm.activation_tpu.gated_vjp`, one Pallas pass (what
  `gmm_backend="auto"` takes on a TPU), at its own rows per step and at `--tm`'s;
- `forward`: the activation itself (`moe_eqx._activation.activate`), for scale.

`ms` is the device time of the call's ops from a profiler trace (the wall clock of
one call also holds about half a millisecond of the host's dispatch); `GB/s` counts
the bytes read and written once. With `--activations`, each of the kernel's
activations (`KERNEL_ACTIVATIONS`, with their variants) is compiled for the chip and
checked against `XLA, halves`.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import jax.random as jr
from tpu_layer import device_ops

import moe_eqx as me
from moe_eqx._activation import activate, halves_cotangent
from moe_eqx._gmm import activation_tpu
from moe_eqx._gmm.activation_tpu import in_kernel

SHAPES = {  # rows (tokens x k), d_ff
    "dsv2lite": (8192 * 6, 1408),
    "qwen3": (8192 * 8, 768),
    "mixtral": (4096 * 2, 3584),
    "tiny": (512, 256),  # a smoke test off the TPU (`--interpret`)
}
ACT = me.SwiGLU()
F32 = jnp.float32
VARIANTS = [
    me.SwiGLU(),
    me.SwiGLU(limit=7.0),
    me.SwiGLU(limit=7.0, limit_after=True),
    me.GeGLU(),
    me.GeGLU(approximate=True),
    me.ClampedSwiGLU(limit=7.0),
    me.SoftcapSwiGLU(gate_cap=10.0, up_cap=20.0),
]


def xla_halves(h, ct, act=ACT):
    return halves_cotangent(act, h, ct)


def xla_one_vjp(h, ct):
    return ACT.vjp(h.astype(F32), ct).astype(h.dtype)


def kernel(h, ct, *, interpret, tm=None, act=ACT):
    if tm is None:
        return activation_tpu.gated_vjp(act, h, ct, interpret=interpret)
    saved = activation_tpu._rows_per_step
    activation_tpu._rows_per_step = lambda *_: tm
    try:
        return activation_tpu._gated_vjp.__wrapped__(act, interpret, h, ct)
    finally:
        activation_tpu._rows_per_step = saved


def forward(h, ct):
    return activate(ACT, h, h.dtype)


def timed(fn, *args, repeats=10):
    """`(wall ms, device ms or None, output)` of the jitted `fn`."""
    compiled = jax.jit(fn).lower(*args).compile()
    out = jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - t0)
    ops = device_ops(lambda *_: compiled(*args), None, None)
    device = sum(ms for _, ms in ops) if ops else None
    return best * 1e3, device, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="dsv2lite,qwen3")
    p.add_argument("--tm", default="128,256,512", help="rows a kernel step, also")
    p.add_argument("--activations", action="store_true")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = []
    for name in args.shapes.split(","):
        m, d = SHAPES[name]
        kh, kc = jr.split(jr.key(0))
        h = (2 * jr.normal(kh, (m, 2 * d), F32)).astype(jnp.bfloat16)
        ct = jr.normal(kc, (m, d), F32).astype(jnp.bfloat16)
        rows = {
            "XLA, halves": xla_halves,
            "XLA, one vjp": xla_one_vjp,
            "kernel": lambda h, ct: kernel(h, ct, interpret=args.interpret),
        }
        for tm in args.tm.split(",") if args.tm else ():
            rows[f"kernel, tm={tm}"] = lambda h, ct, tm=int(tm): kernel(
                h, ct, interpret=args.interpret, tm=tm
            )
        rows["forward"] = forward
        first = None
        for row, fn in rows.items():
            nbytes = 2 * m * (3 * d if row == "forward" else 5 * d)
            try:
                wall, device, out = timed(fn, h, ct)
            except Exception as e:  # noqa: BLE001 -- a row that does not lower
                results.append(dict(shape=name, row=row, error=str(e)[:300]))
                print(f"{name:9s} {row:16s} failed: {str(e)[:300]}")
                continue
            diff = None
            if row != "forward":
                first = out if first is None else first
                diff = float(jnp.max(jnp.abs(out.astype(F32) - first.astype(F32))))
            ms = device if device is not None else wall
            results.append(
                dict(
                    shape=name,
                    row=row,
                    wall_ms=wall,
                    device_ms=device,
                    gbps=nbytes / ms / 1e6,
                    max_diff=diff,
                )
            )
            print(
                f"{name:9s} {row:16s} wall {wall:7.3f} ms  device "
                f"{device if device is not None else float('nan'):7.3f} ms "
                f"{nbytes / ms / 1e6:7.1f} GB/s  max|diff| {diff}",
                flush=True,
            )
    if args.activations:
        m, d = 4096, 768
        h = (4 * jr.normal(jr.key(2), (m, 2 * d), F32)).astype(jnp.bfloat16)
        ct = jr.normal(jr.key(3), (m, d), F32).astype(jnp.bfloat16)
        for act in VARIANTS:
            label = repr(act) + ("" if in_kernel(act, h) else " (JAX's vjp: not taken)")
            try:
                got = jax.jit(
                    lambda h, ct, act=act: kernel(
                        h, ct, interpret=args.interpret, act=act
                    )
                )(h, ct)
                want = jax.jit(lambda h, ct, act=act: xla_halves(h, ct, act))(h, ct)
                err = jnp.abs(got.astype(F32) - want.astype(F32))
                scale = jnp.maximum(jnp.abs(want.astype(F32)), 1.0)
                rel = float(jnp.max(err / scale))
                results.append(dict(activation=label, max_rel_diff=rel))
                print(f"activation {label}: max |diff| / max(|want|, 1) {rel:.3g}")
            except Exception as e:  # noqa: BLE001
                results.append(dict(activation=label, error=str(e)[:300]))
                print(f"activation {label}: failed: {str(e)[:300]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
