"""`LayerOutput`: the last stage of a layer, which scales the routed experts' output
and transforms the sum (a bias, an RMSNorm). Each of its settings lives here alone;
`MoEConfig.routed_scaling_factor` and `MoEConfig.output` are the recipe it is built
from."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._checks import check_positive
from ._combine import OutputTransform, add_output_bias, norm_output
from ._settings import real


class LayerOutput(eqx.Module):
    """What the layer does to its output: `y = routed_scale * routed + shared`, then
    `y + bias`, then an RMSNorm of `y` over `d_model` (each optional).

    **Fields:**

    - `routed_scale`: multiplies the routed experts' weighted sum before the shared
        experts' output is added (`MoEConfig.routed_scaling_factor`: DeepSeek-V3's
        2.5, for example); applied on each shard with the shared experts.
    - `bias`: `[d_model]` added once to every token's output (JetMoE's block bias,
        `OutputTransform.bias`), or `None`.
    - `norm`: `[d_model]`, the weight of an RMSNorm of the output (A.X-K1's
        `post_mlp_layernorm`), or `None`.
    - `norm_eps`: that RMSNorm's epsilon (`OutputTransform.norm_eps`); `None` exactly
        when `norm` is.

    Change one with `eqx.tree_at` (an array) or `dataclasses.replace` (a setting),
    e.g. `eqx.tree_at(lambda l: l.output, layer, dataclasses.replace(layer.output,
    routed_scale=2.0))`; the layer's `config` reads them from here.
    """

    bias: Float[Array, " d_model"] | None = None
    norm: Float[Array, " d_model"] | None = None
    routed_scale: float = eqx.field(static=True, default=1.0, converter=real)
    norm_eps: float | None = eqx.field(static=True, default=None, converter=real)

    def __check_init__(self):
        check_positive(self.routed_scale, "routed_scale", "LayerOutput")
        check_positive(self.norm_eps, "norm_eps", "LayerOutput", optional=True)
        if (self.norm is None) != (self.norm_eps is None):
            raise ValueError(
                "`LayerOutput.norm` (the RMSNorm's weight) and `norm_eps` (its "
                f"epsilon) go together; got norm {'None' if self.norm is None else 'an array'}"
                f" and norm_eps {self.norm_eps!r}."
            )

    @property
    def transform(self) -> OutputTransform:
        """The recipe of this stage's bias and norm (`MoEConfig.output`)."""
        return OutputTransform(bias=self.bias is not None, norm_eps=self.norm_eps)

    def __call__(
        self, y: Float[Array, "*batch d_model"]
    ) -> Float[Array, "*batch d_model"]:
        """`y` (the routed and shared experts' sum) with the bias added, then
        normalised; `y` itself without either."""
        return norm_output(add_output_bias(y, self.bias), self.norm, self.norm_eps)


def layer_output(config, dtype) -> LayerOutput:
    """The output stage `config` describes: a zero bias and a unit norm weight
    where it asks for them."""
    h, out = config.d_model, config.output
    return LayerOutput(
        bias=jnp.zeros((h,), dtype) if out.bias else None,
        norm=jnp.ones((h,), dtype) if out.norm_eps is not None else None,
        routed_scale=config.routed_scaling_factor,
        norm_eps=out.norm_eps,
    )
