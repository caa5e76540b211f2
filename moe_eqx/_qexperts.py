"""A layer's routed experts kept quantized in memory, and back to floats."""

import equinox as eqx
import jax.numpy as jnp

from ._quant import AbstractQuantFormat, QuantizedArray, quant_format, quantize


def _expert_weights(layer):
    return lambda m: (m.experts.w_gate_up, m.experts.w_down)


def quantize_experts(layer, fmt: str | AbstractQuantFormat):
    """`layer` with its routed experts' weights `w_gate_up` and `w_down` stored as
    [`moe_eqx.QuantizedArray`][]s in `fmt` (see `moe_eqx.internal.quantize`). The
    router, the experts' biases and the shared experts stay as they are.

    A quantized weight is a constant for autodiff: its arrays are integers, so
    `eqx.filter_grad` gives gradients for `x`, the router, the biases and the shared
    experts only.

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][] with float expert weights (already quantized
        ones are a `ValueError`).
    - `fmt`: `"float8_e4m3fn"` (128 x 128 block scales), `"mxfp4"` (blocks of 32
        along the contracting axis, E8M0 scales; `d_model` and `d_ff` multiples of
        32), `"int8"` (a scale per output channel), or the name or instance of a
        format of your own ([`moe_eqx.AbstractQuantFormat`][]).

    **Returns:**

    The layer with quantized experts, which dequantize to the weights' dtype.
    """
    fmt = quant_format(fmt)
    weights = _expert_weights(layer)(layer)
    if any(isinstance(w, QuantizedArray) for w in weights):
        raise ValueError(
            "`layer.experts` is already quantized: `me.dequantize_experts` it first."
        )
    return eqx.tree_at(
        _expert_weights(layer), layer, tuple(quantize(w, fmt) for w in weights)
    )


def dequantize_experts(layer, dtype=None):
    """`layer` with its quantized expert weights as float arrays (a layer without
    quantized weights is returned as is).

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][].
    - `dtype`: the float dtype; default: each weight's own (`QuantizedArray.dtype`).

    **Returns:**

    The layer with float expert weights.
    """
    weights = _expert_weights(layer)(layer)
    if not any(isinstance(w, QuantizedArray) for w in weights):
        return layer
    new = tuple(
        w.dequantize(dtype)
        if isinstance(w, QuantizedArray)
        else w.astype(w.dtype if dtype is None else jnp.dtype(dtype))
        for w in weights
    )
    return eqx.tree_at(_expert_weights(layer), layer, new)
