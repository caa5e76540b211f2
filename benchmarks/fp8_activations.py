"""What FP8 tensor-core operands would cost in accuracy: an expert FFN with FP8
(E4M3, 128 x 128 block-scaled) weights, computed once with bfloat16 activations (what
the `mosaic_gpu` kernels do: the weight tile dequantized to bfloat16 in the kernel)
and once with the activations quantized to E4M3 as an FP8 x FP8 tensor-core product
needs them (one scale per token and 128 channels, DeepSeek-V3's and DeepGEMM's
scheme), both products accumulated in float32 on CPU.

    python3 benchmarks/fp8_activations.py

Prints the relative error of the FP8-activation FFN against the bfloat16-activation
one (max over elements and RMS, both over the output's scale), and, for scale, the
RMS error of rounding the output to bfloat16 alone.
"""

import jax
import jax.numpy as jnp
import numpy as np

from moe_eqx._quant import quantize

TOKENS, D_MODEL, D_FF = 256, 512, 256


def fp8_activations(a):
    """`a` quantized to E4M3 with one scale per token and 128 channels, as floats."""
    blocks = a.astype(jnp.float32).reshape(a.shape[0], -1, 128)
    scale = jnp.max(jnp.abs(blocks), -1, keepdims=True) / 448
    q = (blocks / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return q.reshape(a.shape)


def main():
    rng = np.random.default_rng(0)
    f32 = jnp.float32
    x = jnp.asarray(rng.standard_normal((TOKENS, D_MODEL)), jnp.bfloat16)
    w_gate_up, w_down = (
        quantize(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), f32), fmt)
        .dequantize(jnp.bfloat16)
        .astype(f32)
        for shape, fmt in (
            ((D_MODEL, 2 * D_FF), "float8_e4m3fn"),
            ((D_FF, D_MODEL), "float8_e4m3fn"),
        )
    )

    def ffn(x, quantize_activations):
        cast = fp8_activations if quantize_activations else (lambda a: a.astype(f32))
        gate, up = jnp.split(jnp.dot(cast(x), w_gate_up), 2, -1)
        hidden = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)
        return jnp.dot(cast(hidden), w_down)

    y, y_fp8 = ffn(x, False), ffn(x, True)
    scale = float(jnp.max(jnp.abs(y)))
    rms = lambda e: float(jnp.sqrt(jnp.mean(e**2) / jnp.mean(y**2)))  # noqa: E731
    print(f"FFN {TOKENS} tokens, d_model {D_MODEL}, d_ff {D_FF}, FP8 weights")
    worst = float(jnp.max(jnp.abs(y_fp8 - y))) / scale
    print(f"FP8 activations: max |error| / max |y| {worst:.4f}, ", end="")
    print(f"RMS relative {rms(y_fp8 - y):.4f}")
    y_bf16 = y.astype(jnp.bfloat16).astype(f32)
    print(f"bfloat16 rounding of the output alone: RMS relative {rms(y_bf16 - y):.4f}")


if __name__ == "__main__":
    main()
