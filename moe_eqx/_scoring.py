"""The parts the built-in router is composed of: how logits become scores
(`AbstractScore`: softmax, sigmoid, `sqrt(softplus)`, with an optional soft-cap and
logit bias), how experts are selected from them (`Selection`: top-k, group-limited),
and how the chosen scores become routing weights (`Weighting`).

A model family's routing variant is a field of the part that computes it (Laguna's
soft-cap of `Sigmoid`, DeepSeek-V2's group score and A.X-K2's fill of `Selection`,
ERNIE-4.5's floor of `Weighting`), composed by the importer into the config's
`score_func`, `selection` and `weighting`.
"""

import abc
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._checks import check_int
from ._settings import boolean, integer, real


def _finite_at_least(value, low: float, name: str, *, inf_ok: bool = False) -> None:
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and (math.isfinite(value) or (inf_ok and value == -math.inf))
        and value >= low
    )
    if not ok:
        raise ValueError(
            f"`{name}` must be a finite number >= {low}"
            + (" (or -inf)" if inf_ok else "")
            + f", got {value!r}."
        )


class AbstractScore(eqx.Module):
    """How the router turns its logits into per-expert scores.

    The router computes `logits = x @ weight (+ logit_bias)` in float32, soft-caps
    them (`softcap * tanh(logits / softcap)` when `softcap > 0`), and calls the
    score: `scores = score(logits)`. The weights of the chosen experts come from the
    scores; the experts are chosen by the scores (or the logits, see
    [`moe_eqx.Selection`][]) plus the selection bias.

    Subclasses define `__call__`, the fields `softcap: float` and
    `logit_bias: bool` (whether the router has a trained bias on its logits), and
    the class attribute `sums_to_one: ClassVar[bool]` (the scores of a token
    already sum to 1 over the experts, as a softmax's do; else the balance loss
    normalises them).
    """

    softcap: eqx.AbstractVar[float]
    logit_bias: eqx.AbstractVar[bool]
    sums_to_one: eqx.AbstractClassVar[bool]

    @abc.abstractmethod
    def __call__(
        self, logits: Float[Array, "tokens columns"]
    ) -> Float[Array, "tokens columns"]:
        """Per-expert scores of float32 logits, float32, same shape."""

    def __check_init__(self):
        _finite_at_least(self.softcap, 0.0, f"{type(self).__name__}.softcap")
        if not isinstance(self.logit_bias, bool):
            raise ValueError(
                f"`{type(self).__name__}.logit_bias` must be True or False, got "
                f"{self.logit_bias!r}."
            )


class Softmax(AbstractScore):
    """Softmax scores over the experts (Mixtral, Qwen, DeepSeek-V2, ...).

    **Fields:**

    - `softcap`: tanh soft-cap of the logits, `0` (default): none.
    - `logit_bias`: the router has a trained bias on its logits (GPT-OSS:
        `layer.router.logit_bias`); unlike the selection bias it changes the
        weights too.
    """

    softcap: float = eqx.field(static=True, default=0.0, converter=real)
    logit_bias: bool = eqx.field(static=True, default=False, converter=boolean)
    sums_to_one: ClassVar[bool] = True

    def __call__(self, logits):
        return jax.nn.softmax(logits, axis=-1)


class Sigmoid(AbstractScore):
    """Per-expert sigmoid scores (DeepSeek-V3, ...); fields as
    [`moe_eqx.Softmax`][]'s (Laguna soft-caps its logits)."""

    softcap: float = eqx.field(static=True, default=0.0, converter=real)
    logit_bias: bool = eqx.field(static=True, default=False, converter=boolean)
    sums_to_one: ClassVar[bool] = False

    def __call__(self, logits):
        return jax.nn.sigmoid(logits)


class SqrtSoftplus(AbstractScore):
    """Per-expert `sqrt(softplus(logit))` scores (DeepSeek-V4); fields as
    [`moe_eqx.Softmax`][]'s."""

    softcap: float = eqx.field(static=True, default=0.0, converter=real)
    logit_bias: bool = eqx.field(static=True, default=False, converter=boolean)
    sums_to_one: ClassVar[bool] = False

    def __call__(self, logits):
        return jnp.sqrt(jax.nn.softplus(logits))


# The names `MoEConfig(score_func=...)` takes as shorthands.
SCORES: dict[str, AbstractScore] = {
    "softmax": Softmax(),
    "sigmoid": Sigmoid(),
    "sqrtsoftplus": SqrtSoftplus(),
}


def as_score(value) -> AbstractScore:
    """The score object of `score_func`: an [`moe_eqx.AbstractScore`][] as it is, or
    a name of `SCORES`; anything else a `ValueError` naming the field."""
    if isinstance(value, AbstractScore):
        return value
    if isinstance(value, str) and value in SCORES:
        return SCORES[value]
    raise ValueError(
        f"`score_func` must be one of {tuple(SCORES)} or an "
        f"`moe_eqx.AbstractScore`, got {value!r}."
    )


def soft_cap(logits: Array, cap: float) -> Array:
    """`cap * tanh(logits / cap)`, or the logits when `cap` is 0."""
    if not cap:
        return logits
    return jnp.float32(cap) * jnp.tanh(logits / jnp.float32(cap))


class Selection(eqx.Module):
    """How the router chooses a token's `top_k` experts: the top-k of the selection
    scores, within the token's best groups with group-limited routing
    (`MoEConfig.num_groups > 1`).

    **Fields:**

    - `group_top`: a group's score is the sum of its best `min(group_top, experts
        per group)` selection scores: `2` (default, DeepSeek-V3) or `1`, its best
        one (DeepSeek-V2's `group_limited_greedy`).
    - `group_fill`: the selection score of the experts outside a token's kept groups:
        `-inf` (default: never chosen), or a finite value they compete with (A.X-K2
        fills them with 0).
    - `bias_on_logits`: the selection bias is added to the logits instead of the
        scores, `experts = top_k(logits + bias)` (Kolibri-1); the weights are still
        the chosen experts' scores. Needs a selection bias and no groups.
    """

    group_top: int = eqx.field(static=True, default=2, converter=integer)
    group_fill: float = eqx.field(static=True, default=-math.inf, converter=real)
    bias_on_logits: bool = eqx.field(static=True, default=False, converter=boolean)

    def __check_init__(self):
        check_int(self.group_top, "Selection.group_top")
        _finite_at_least(
            self.group_fill, -math.inf, "Selection.group_fill", inf_ok=True
        )
        if not isinstance(self.bias_on_logits, bool):
            raise ValueError(
                f"`Selection.bias_on_logits` must be True or False, got "
                f"{self.bias_on_logits!r}."
            )

    def __call__(
        self,
        logits: Float[Array, "tokens columns"],
        scores: Float[Array, "tokens columns"],
        bias: Float[Array, " columns"] | None,
        *,
        top_k: int,
        num_groups: int = 1,
        top_groups: int = 1,
    ) -> Int[Array, "tokens k"]:
        """The `[T, k]` int32 chosen experts (no gradient flows through the choice)."""
        # Scores are monotone in the logits: selecting on either is the same but for
        # the bias (Kolibri-1 adds it to the logits).
        select = jax.lax.stop_gradient(logits if self.bias_on_logits else scores)
        if bias is not None:
            # (In the scores' dtype: a bias cast with the other leaves, say to
            # bfloat16, still selects.)
            bias = jax.lax.stop_gradient(bias).astype(select.dtype)
            select = select + bias[None, :]
        if num_groups > 1:
            keep = self._group_mask(select, num_groups, top_groups)
            select = jnp.where(keep, select, jnp.float32(self.group_fill))
        _, experts = jax.lax.top_k(select, top_k)
        return experts.astype(jnp.int32)

    def _group_mask(
        self, select, num_groups: int, top_groups: int
    ) -> Bool[Array, "tokens columns"]:
        tokens, num_experts = select.shape
        per_group = num_experts // num_groups
        grouped = select.reshape(tokens, num_groups, per_group)
        best = jax.lax.top_k(grouped, min(self.group_top, per_group))[0]
        _, top_group_idx = jax.lax.top_k(jnp.sum(best, axis=-1), top_groups)
        group_ok = jnp.zeros((tokens, num_groups), bool)
        group_ok = group_ok.at[jnp.arange(tokens)[:, None], top_group_idx].set(True)
        return jnp.repeat(group_ok, per_group, axis=1)


class Weighting(eqx.Module):
    """How the chosen experts' scores become routing weights: as they are, or
    renormalised to sum to 1 (`MoEConfig.norm_topk`), together with the scores of
    the shared experts the router scores (`SharedCombination.scored`: one
    denominator for both).

    **Fields:**

    - `floor`: the renormalisation's divisor is `max(sum, floor)` (ERNIE-4.5's
        `moe_norm_min`): a token whose chosen scores sum below it keeps weights
        summing below 1; `0` (default): the sum. Needs `norm_topk`.
    """

    floor: float = eqx.field(static=True, default=0.0, converter=real)

    def __check_init__(self):
        _finite_at_least(self.floor, 0.0, "Weighting.floor")

    def __call__(
        self,
        chosen: Float[Array, "tokens k"],
        shared: Float[Array, "tokens shared"] | None,
        *,
        normalize: bool,
    ) -> tuple[Float[Array, "tokens k"], Float[Array, "tokens shared"] | None]:
        """`(weights, shared weights)` of the chosen and shared experts' scores."""
        if not normalize:
            return chosen, shared
        total = jnp.sum(chosen, axis=-1, keepdims=True)
        if shared is not None:  # one denominator for routed and shared
            total = total + jnp.sum(shared, axis=-1, keepdims=True)
        if self.floor > 0:
            total = jnp.maximum(total, self.floor)
        return chosen / total, None if shared is None else shared / total


def check_routing_settings(
    *,
    num_experts: int,
    num_identity: int,
    top_k: int,
    num_groups: int,
    top_groups: int,
    has_bias: bool,
    norm_topk: bool,
    selection: Selection,
    weighting: Weighting,
    where: str = "",
) -> None:
    """The routing settings' cross-checks, the same for `MoEConfig` and `Router`
    (`where`: the class named in the errors, `""` for the config's): `top_k`
    within the experts, whole expert groups holding `top_k` experts, and what the
    selection and the weighting need."""

    def fail(message):
        raise ValueError(f"{where}: {message}" if where else message)

    field = f"{where}." if where else ""
    if top_k > num_experts + num_identity:
        fail(
            f"`top_k` ({top_k}) must not exceed `num_experts` ({num_experts})"
            + (
                f" plus `num_identity_experts` ({num_identity})."
                if num_identity
                else "."
            )
        )
    check_int(num_groups, field + "num_groups")
    if num_experts % num_groups != 0:
        fail(
            f"`num_experts` ({num_experts}) must be divisible by `num_groups` "
            f"({num_groups})."
        )
    check_int(top_groups, field + "top_groups", maximum=num_groups)
    if num_groups > 1 and top_groups * (num_experts // num_groups) < top_k:
        fail(
            f"`top_groups` ({top_groups}) groups of {num_experts // num_groups} "
            f"experts hold fewer than `top_k` ({top_k}) experts."
        )
    if selection.bias_on_logits:
        if not has_bias:
            fail(
                "`Selection(bias_on_logits=True)` needs a selection bias "
                "(`use_router_bias=True`; without one, the top-k of the logits is "
                "the top-k of the scores)."
            )
        if num_groups > 1:
            fail(
                "`Selection(bias_on_logits=True)` with group-limited routing is "
                "not supported."
            )
    if weighting.floor > 0 and not norm_topk:
        fail(
            "`Weighting(floor=...)` > 0 floors the renormalisation's divisor: it "
            "needs `norm_topk=True`."
        )
