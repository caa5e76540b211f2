"""Peak memory of importing one Hugging Face MoE layer, against the layer's size.

    python3 benchmarks/hf_import.py            # E=64, d_model=1024, d_ff=512, float32
    python3 benchmarks/hf_import.py --quick    # E=8, d_model=256, d_ff=128

`me.layer_from_hf_state_dict` builds the layer from an abstract skeleton (no random
weights drawn) and writes each expert array once: fused layouts
(`experts.gate_up_proj [E, 2F, H]`) are transposed on their way to the device,
per-expert layouts (`experts.{i}.gate_proj.weight ...`) are assembled on the device one
expert at a time into a buffer updated in place. Each layout runs in a fresh process
(the peak resident set size only grows), after the state dict is built: the row is
the growth of the peak over the layer's own bytes. Goal: <= 1.2x. Writes
benchmarks/results/hf_import.json.
"""

import argparse
import json
import subprocess
import sys

from _common import print_table, write_json

_CHILD = r"""
import gc, json, resource, sys
import numpy as np
E, H, F, layout = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(0)
sd = {"gate.weight": rng.standard_normal((E, H), np.float32)}
if layout == "fused":
    sd["experts.gate_up_proj"] = rng.standard_normal((E, 2 * F, H), np.float32)
    sd["experts.down_proj"] = rng.standard_normal((E, H, F), np.float32)
else:
    for i in range(E):
        sd[f"experts.{i}.gate_proj.weight"] = rng.standard_normal((F, H), np.float32)
        sd[f"experts.{i}.up_proj.weight"] = rng.standard_normal((F, H), np.float32)
        sd[f"experts.{i}.down_proj.weight"] = rng.standard_normal((H, F), np.float32)
import jax, jax.numpy as jnp
import moe_eqx as me
config = me.MoEConfig(d_model=H, d_ff=F, num_experts=E, top_k=2)
jnp.ones(3).block_until_ready()
gc.collect()
with open("/proc/self/statm") as f:
    current = int(f.read().split()[1]) * 4096
before = max(current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
layer = me.layer_from_hf_state_dict(config, sd)
jax.block_until_ready(layer)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
size = sum(a.nbytes for a in jax.tree.leaves(layer))
print(json.dumps({"growth_bytes": after - before, "layer_bytes": size}))
"""


def measure(experts, d_model, d_ff, layout):
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(experts), str(d_model), str(d_ff), layout],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small layer")
    args = parser.parse_args(argv)
    shape = (8, 256, 128) if args.quick else (64, 1024, 512)
    rows = []
    for layout in ("fused", "per-expert"):
        m = measure(*shape, layout)
        rows.append(
            {
                "layout": layout,
                "layer_mib": m["layer_bytes"] / 2**20,
                "peak_growth_mib": m["growth_bytes"] / 2**20,
                "ratio": m["growth_bytes"] / m["layer_bytes"],
                "goal": "<= 1.2",
            }
        )
        rows[-1]["met"] = rows[-1]["ratio"] <= 1.2
    print_table(
        rows, ["layout", "layer_mib", "peak_growth_mib", "ratio", "goal", "met"]
    )
    payload = dict(zip(("experts", "d_model", "d_ff"), shape, strict=True))
    write_json("hf_import", {"shape": payload, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
