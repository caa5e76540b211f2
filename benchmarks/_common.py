"""Shared benchmark plumbing: simulated devices, tables, JSON output, memory."""

import functools
import json
import os
import pathlib
import sys


def setup_devices(n: int = 8) -> None:
    """Simulated CPU devices; must run before jax is imported."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(
            "  ".join(
                fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)
            )
        )


def write_json(name: str, payload: dict) -> pathlib.Path:
    out = pathlib.Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float))
    print(f"\nwrote {path}")
    return path


def compiled_memory(fn, *args) -> dict:
    """Compiled per-device memory of `jax.jit(fn)(*args)` from `memory_analysis()`."""
    import jax

    ma = jax.jit(fn).lower(*args).compile().memory_analysis()
    temp, out = ma.temp_size_in_bytes, ma.output_size_in_bytes
    return {
        "temp_mib": temp / 2**20,
        "output_mib": out / 2**20,
        "peak_mib": (temp + out) / 2**20,
        "argument_mib": ma.argument_size_in_bytes / 2**20,
    }


def interleaved_min(candidates: dict, repeats: int) -> dict:
    """Min seconds of each `name -> (fn, args)`, run round-robin `repeats` times after
    one untimed call each, so every candidate sees the same load (the CPU is shared)."""
    import time

    import jax

    for fn, args in candidates.values():
        jax.block_until_ready(fn(*args))
    best = {name: float("inf") for name in candidates}
    for _ in range(repeats):
        for name, (fn, args) in candidates.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@functools.cache
def jitted_plan(num_slots: int):
    """`moe_eqx.plan_duplication` jitted for `num_slots` (one compilation per count)."""
    import jax

    from moe_eqx import plan_duplication

    return jax.jit(functools.partial(plan_duplication, num_slots=num_slots))


def max_over_mean(load) -> float:
    """Max/mean of a load vector, in float64."""
    import numpy as np

    load = np.asarray(load, np.float64)
    return float(load.max() / load.mean())
