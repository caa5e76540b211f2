"""How far each quantized format puts the layer from its float self: the relative
error `||y_q - y|| / ||y||` of the output, random weights and tokens, three seeds.

    python3 benchmarks/quantized_error.py

`MoEConfig(d_model=512, d_ff=256, num_experts=16, top_k=4)`, float32, 512 tokens,
`jax.default_matmul_precision("highest")`, one device. Prints a table and writes
benchmarks/results/quantized_error.json.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
from _common import print_table, write_json

import moe_eqx as me

FORMATS = ("int8", "float8_e4m3fn", "mxfp4")


def main():
    jax.config.update("jax_default_matmul_precision", "highest")
    rows = []
    for seed in range(3):
        cfg = me.MoEConfig(d_model=512, d_ff=256, num_experts=16, top_k=4)
        layer = me.MoELayer(cfg, key=jr.key(seed))
        x = jr.normal(jr.key(100 + seed), (512, cfg.d_model))
        y = layer(x)[0]
        row = {"seed": seed}
        for fmt in FORMATS:
            yq = me.quantize_experts(layer, fmt)(x)[0]
            row[fmt] = float(jnp.linalg.norm(yq - y) / jnp.linalg.norm(y))
        rows.append(row)
    print_table(rows, ["seed", *FORMATS])
    write_json("quantized_error", {"rows": rows})


if __name__ == "__main__":
    main()
