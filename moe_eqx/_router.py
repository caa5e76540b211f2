"""Router stage: the interface (`AbstractRouter`), the routing it returns, the built-in\nrouter, and the auxiliary losses."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._checks import check_array, check_int
from ._rules import histogram, pick_columns
from ._scoring import (
    AbstractScore,
    Selection,
    Weighting,
    as_score,
    check_routing_settings,
    soft_cap,
)


class Routing(eqx.Module):
    """The router's decision for the tokens of one shard.

    **Fields:**

    - `weights`: `[T, k]` float32 routing weights of the chosen experts.
    - `experts`: `[T, k]` int32 chosen experts, distinct per token; `E + j` is
        identity expert `j` (`config.num_identity_experts`), which returns its input.
    - `counts`: `[E]` int32 pairs routed to each routed expert from these tokens
        (identity experts' pairs are computed at home and not counted here).
    - `identity_counts`: `[I]` int32 pairs routed to each identity expert
        (`config.num_identity_experts`; `[0]` without them) from these tokens.
    - `mean_probs`: `[E]` float32 mean normalised score per expert (for the balance loss).
    - `load_balance_loss`: scalar `E * sum_e f_e * P_e` over these tokens.
    - `router_z_loss`: scalar `mean(logsumexp(logits)^2)` over these tokens.
    - `bad_ids`: scalar int32, the forced expert ids (routing replay) that are out of
        range or repeat an earlier id of their token; 0 without forced ids.
    - `shared_weights`: `[T, S]` float32 weights of the shared experts scored by the
        router (`SharedCombination.scored = S`), else `None`.
    """

    weights: Float[Array, "tokens k"]
    experts: Int[Array, "tokens k"]
    counts: Int[Array, " experts"]
    mean_probs: Float[Array, " experts"]
    load_balance_loss: Float[Array, ""]
    router_z_loss: Float[Array, ""]
    identity_counts: Int[Array, " identity"]
    # A default, so that routings built by hand (or by a user's own router) need not
    # name it.
    bad_ids: Int[Array, ""] = eqx.field(default_factory=lambda: jnp.array(0, jnp.int32))
    shared_weights: Float[Array, "tokens shared"] | None = None


def bad_expert_ids(
    experts: Int[Array, "tokens k"], num_columns: int
) -> Bool[Array, "tokens k"]:
    """The forced expert ids that cannot be a routing: out of `[0, num_columns)` or
    equal to an earlier id of the same token.

    **Arguments:**

    - `experts`: `[T, k]` expert ids.
    - `num_columns`: `E + I`, the routed and identity experts.

    **Returns:**

    `[T, k]` bool, true at each bad id.
    """
    k = experts.shape[-1]
    out = (experts < 0) | (experts >= num_columns)
    earlier = jnp.tril(jnp.ones((1, k, k), bool), -1)  # [_, j, i]: i before j
    same = experts[:, :, None] == experts[:, None, :]
    return out | jnp.any(same & earlier, axis=-1)


def check_expert_ids(
    ids,
    batch_shape: tuple[int, ...],
    *,
    top_k: int,
    num_experts: int,
    num_identity: int,
) -> None:
    """Forced expert ids (routing replay) fit the tokens and the layer, else a
    `TypeError` (not integers) or `ValueError` naming what is wrong. Their values
    are checked where they are concrete; traced ones are counted in the stats
    instead (`MoEStats.bad_expert_ids`).

    **Arguments:**

    - `ids`: the `experts=` argument, `[..., k]`.
    - `batch_shape`: the tokens' leading dimensions (`x.shape[:-1]`).
    - `top_k`, `num_experts`, `num_identity`: `k`, `E` and `I`, the layer's.
    """
    dtype = getattr(ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"`experts` (forced expert ids) must be an integer array, got dtype {dtype}."
        )
    want = (*batch_shape, top_k)
    if tuple(ids.shape) != want:
        raise ValueError(
            f"`experts` (forced expert ids) must have shape {want} (the tokens' "
            f"leading dimensions, then `config.top_k`), got {tuple(ids.shape)}."
        )
    if isinstance(ids, jax.core.Tracer) or ids.size == 0:
        return
    columns = num_experts + num_identity
    # In NumPy: under an outer `jit` a JAX operation would be staged, even on a
    # concrete array.
    flat = np.asarray(ids).reshape(-1, top_k)
    earlier = np.tril(np.ones((top_k, top_k), bool), -1)
    repeated = np.any((flat[:, :, None] == flat[:, None, :]) & earlier, axis=-1)
    bad = (flat < 0) | (flat >= columns) | repeated
    if bool(np.any(bad)):
        tokens = np.nonzero(np.any(bad, axis=-1))[0]
        first = int(tokens[0])
        raise ValueError(
            f"`experts` (forced expert ids) must be distinct per token and in "
            f"[0, {columns}) (`num_experts` {num_experts} + "
            f"`num_identity_experts` {num_identity}): "
            f"{int(np.sum(bad))} bad ids in {tokens.size} tokens, the first at "
            f"token {first} (flattened): {flat[first].tolist()}."
        )


def check_routing(
    routing, *, tokens: int, top_k: int, num_experts: int, num_identity: int, router
) -> None:
    """A router's output fits the layer (the [`moe_eqx.AbstractRouter`][] contract),
    else a `ValueError` naming the router and the field: a user's own router whose
    output is not what it declares (its `top_k`, `num_experts`, ...)."""
    name = type(router).__name__
    if not isinstance(routing, Routing):
        raise ValueError(
            f"The router {name} returned {type(routing).__name__}, not an "
            "`moe_eqx.Routing`."
        )
    want = {
        "weights": (tokens, top_k),
        "experts": (tokens, top_k),
        "counts": (num_experts,),
        "mean_probs": (num_experts,),
        "identity_counts": (num_identity,),
    }
    for field, shape in want.items():
        have = tuple(getattr(routing, field).shape)
        if have != shape:
            raise ValueError(
                f"The router {name} returned `Routing.{field}` of shape {have}; the "
                f"layer needs {shape} (tokens, `config.top_k` {top_k}, "
                f"`config.num_experts` {num_experts}, `config.num_identity_experts` "
                f"{num_identity}), which the router declares: its output must fit "
                "its own `top_k` and expert counts."
            )


def load_balance_loss(
    counts: Int[Array, " experts"], mean_probs: Float[Array, " experts"]
) -> Float[Array, ""]:
    """Switch/DeepSeek balance loss `E * sum_e f_e * P_e`, with `f_e` the fraction of
    pairs routed to expert `e` and `P_e` its mean normalised score.

    **Arguments:**

    - `counts`: `[E]` pairs per expert.
    - `mean_probs`: `[E]` mean normalised score per expert.

    **Returns:**

    A float32 scalar, 1.0 for perfectly uniform routing.
    """
    num_experts = counts.shape[0]
    total = jnp.maximum(jnp.sum(counts), 1).astype(jnp.float32)
    frac = jax.lax.stop_gradient(counts.astype(jnp.float32) / total)
    return jnp.asarray(num_experts, jnp.float32) * jnp.sum(frac * mean_probs)


class AbstractRouter(eqx.Module):
    """The router stage: which experts each token goes to, and with what weights.

    The layer calls it once per shard on that shard's tokens, and relies on this
    contract alone, so a user's own subclass runs wherever the built-in
    [`moe_eqx.Router`][] does (one device, expert parallel, drop and fallback, slots,
    FSDP, quantized experts, replay, forward mode, second order, and
    [`moe_eqx.reference_moe`][]). Swap it into a layer with
    `eqx.tree_at(lambda l: l.router, layer, my_router)`; the layer replicates it on
    every shard (its arrays are placed `P()`).
    """

    @abc.abstractmethod
    def __call__(
        self,
        x: Float[Array, "tokens d_model"],
        valid: Bool[Array, " tokens"] | None = None,
        *,
        experts: Int[Array, "tokens k"] | None = None,
    ) -> Routing:
        """Routes one shard's tokens.

        **Arguments:**

        - `x`: `[T, d_model]` token activations.
        - `valid`: optional `[T]` mask. A token outside it (padding, or a token with a
            non-finite value) must be routed nowhere: its `experts` all `E + I` (past
            every expert, identity experts included) with weight 0, and counted in no
            statistic.
        - `experts`: optional `[T, k]` forced expert ids (routing replay). A router
            that cannot replay may raise for them; the layer passes them only when
            its caller does.

        **Returns:**

        A [`moe_eqx.Routing`][] with `weights` and `experts` `[T, k]` (`k` the
        layer's `config.top_k`, ids distinct per token, in `[0, E + I)`), `counts`
        and `mean_probs` `[E]`, `identity_counts` `[I]` (`[0]` without identity
        experts), scalar losses, and `shared_weights` `[T, S]` only for a layer whose
        shared experts the router scores (`SharedCombination.scored = S`). The
        layer checks the shapes.
        """


_SELECTION, _WEIGHTING = Selection(), Weighting()


class Router(AbstractRouter):
    """The built-in linear router, composed of a score, a selection and a
    weighting.

    `logits = x @ weight (+ logit_bias)` in float32, soft-capped by the score's
    `softcap`; `scores = score(logits)` ([`moe_eqx.Softmax`][],
    [`moe_eqx.Sigmoid`][], [`moe_eqx.SqrtSoftplus`][], or your own
    [`moe_eqx.AbstractScore`][]); the experts chosen by
    [`moe_eqx.Selection`][] from the scores plus the optional selection `bias`
    (aux-loss-free balancing: it never changes the weights and receives no
    gradient; [`moe_eqx.update_router_bias`][] is the rule to update it), within
    the best `top_groups` of `num_groups` groups; the weights are the chosen
    scores, renormalised by [`moe_eqx.Weighting`][] with `norm_topk`.

    Build it from its own fields (`Router(weight, bias, top_k=..., num_experts=...,
    ...)`) or from a config (`Router(config, key=key)`), as the layer does; each
    setting is a field of the router or of the part that computes it.

    **Fields:**

    - `weight`: `[d_model, E + I + S]`: the routed experts' columns, then those of
        the `I = num_identity` identity experts, then the `S = num_shared` shared
        experts it scores (Inkling).
    - `bias`: `[E + I]` selection bias, or `None`.
    - `logit_bias`: `[E + I]` trained bias of the logits (`score.logit_bias`,
        GPT-OSS), or `None`.
    - `top_k`, `num_experts` (`E`), `num_identity` (`I`), `num_shared` (`S`),
        `num_groups`, `top_groups`, `norm_topk`: static settings.
    - `score`, `selection`, `weighting`: the parts.
    """

    weight: Float[Array, "d_model columns"]
    bias: Float[Array, " experts"] | None
    logit_bias: Float[Array, " experts"] | None
    top_k: int = eqx.field(static=True)
    num_experts: int = eqx.field(static=True)
    num_identity: int = eqx.field(static=True)
    num_shared: int = eqx.field(static=True)
    num_groups: int = eqx.field(static=True)
    top_groups: int = eqx.field(static=True)
    norm_topk: bool = eqx.field(static=True)
    score: AbstractScore = eqx.field(static=True)
    selection: Selection = eqx.field(static=True)
    weighting: Weighting = eqx.field(static=True)

    def __init__(
        self,
        weight,
        bias: Float[Array, " experts"] | None = None,
        logit_bias: Float[Array, " experts"] | None = None,
        *,
        top_k: int | None = None,
        num_experts: int | None = None,
        num_identity: int = 0,
        num_shared: int = 0,
        num_groups: int = 1,
        top_groups: int = 1,
        norm_topk: bool = True,
        score: "AbstractScore | str" = "softmax",
        selection: Selection = _SELECTION,
        weighting: Weighting = _WEIGHTING,
        key: PRNGKeyArray | None = None,
    ):
        """Either from its own fields, `Router(weight, bias, logit_bias, top_k=...,
        num_experts=..., ...)` (each as listed above; `dataclasses.replace` of a
        router works so), or from a config, `Router(config, key=key)`, as the layer
        builds it: the config's routing settings, the weight initialised from
        `key` (normal, scaled by `1 / sqrt(d_model)`) and zero biases where the
        config asks for them.

        **Arguments:**

        - `weight`: `[d_model, E + I + S]`, or a [`moe_eqx.MoEConfig`][].
        - `bias`, `logit_bias`: `[E + I]` or `None`.
        - `top_k`, `num_experts`: required with a weight.
        - `num_identity`, `num_shared`, `num_groups`, `top_groups`, `norm_topk`,
            `score` (an [`moe_eqx.AbstractScore`][] or its name), `selection`,
            `weighting`: as the fields.
        - `key`: with a config only, for the weight's initialisation.
        """
        if not hasattr(weight, "shape"):  # a config
            config = weight
            if key is None:
                raise ValueError("`Router(config, key=...)` needs a `key`.")
            top_k, num_experts = config.top_k, config.num_experts
            num_identity, num_shared = config.num_identity_experts, config.shared.scored
            num_groups, top_groups = config.num_groups, config.top_groups
            norm_topk, score = config.norm_topk, config.score_func
            selection, weighting = config.selection, config.weighting
            columns = num_experts + num_identity
            scale = 1.0 / (config.d_model**0.5)
            weight = scale * jr.normal(
                key, (config.d_model, columns + num_shared), jnp.float32
            )
            zeros = jnp.zeros((columns,), jnp.float32)
            bias = zeros if config.use_router_bias else None
            logit_bias = zeros if as_score(score).logit_bias else None
        elif key is not None:
            raise ValueError("`key` is for `Router(config, key=...)` only.")
        if top_k is None or num_experts is None:
            raise TypeError("`Router(weight, ...)` needs `top_k=` and `num_experts=`.")
        self.weight, self.bias, self.logit_bias = weight, bias, logit_bias
        self.top_k, self.num_experts = top_k, num_experts
        self.num_identity, self.num_shared = num_identity, num_shared
        self.num_groups, self.top_groups = num_groups, top_groups
        self.norm_topk = norm_topk
        self.score = as_score(score)
        self.selection, self.weighting = selection, weighting

    def __check_init__(self):
        where = "Router"
        check_int(self.num_experts, "Router.num_experts")
        check_int(self.num_identity, "Router.num_identity", minimum=0)
        check_int(self.num_shared, "Router.num_shared", minimum=0)
        check_int(self.top_k, "Router.top_k")
        columns = self.num_experts + self.num_identity
        if not isinstance(self.norm_topk, bool):
            raise ValueError(
                f"{where}: `norm_topk` must be True or False, got {self.norm_topk!r}."
            )
        for name, kind in (("selection", Selection), ("weighting", Weighting)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(
                    f"{where}: `{name}` must be a `me.{kind.__name__}`, got "
                    f"{type(getattr(self, name)).__name__}."
                )
        check_routing_settings(
            num_experts=self.num_experts,
            num_identity=self.num_identity,
            top_k=self.top_k,
            num_groups=self.num_groups,
            top_groups=self.top_groups,
            has_bias=self.bias is not None,
            norm_topk=self.norm_topk,
            selection=self.selection,
            weighting=self.weighting,
            where=where,
        )
        if not hasattr(self.weight, "shape"):
            return  # a tree of other leaves (specs, tangents): not an array's
        want = columns + self.num_shared
        if self.weight.ndim != 2 or self.weight.shape[1] != want:
            raise ValueError(
                f"{where}: `weight` must be [d_model, {want}] (num_experts "
                f"{self.num_experts} + num_identity {self.num_identity} + num_shared "
                f"{self.num_shared}), got {tuple(self.weight.shape)}."
            )
        for name in ("bias", "logit_bias"):
            b = getattr(self, name)
            if b is not None and hasattr(b, "shape") and tuple(b.shape) != (columns,):
                raise ValueError(
                    f"{where}: `{name}` must be [{columns}] (num_experts + "
                    f"num_identity), got {tuple(b.shape)}."
                )
        if self.score.logit_bias != (self.logit_bias is not None):
            raise ValueError(
                f"{where}: the score {type(self.score).__name__} "
                + (
                    "adds a `logit_bias`: give one."
                    if self.score.logit_bias
                    else "has no `logit_bias`: give none."
                )
            )

    def scores(self, x: Float[Array, "tokens d_model"]):
        """`(logits, scores, probs, shared)`: the float32 (soft-capped) logits, the
        scores the weights come from, the scores normalised over all experts (for
        the balance loss), and the `[T, S]` scores of the shared experts the router
        scores (`None` without)."""
        logits = jnp.dot(
            x.astype(jnp.float32),
            self.weight.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        if self.logit_bias is not None:
            logits = logits + self.logit_bias.astype(jnp.float32)[None, :]
        logits = soft_cap(logits, self.score.softcap)
        scores = self.score(logits)
        shared = None
        if self.num_shared:  # the shared experts' columns are last
            n = self.num_shared
            logits, scores, shared = logits[:, :-n], scores[:, :-n], scores[:, -n:]
        if self.score.sums_to_one:
            return logits, scores, scores, shared
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        return logits, scores, probs, shared

    def __call__(
        self,
        x: Float[Array, "tokens d_model"],
        valid: Bool[Array, " tokens"] | None = None,
        *,
        experts: Int[Array, "tokens k"] | None = None,
    ) -> Routing:
        """Routes tokens to experts: see [`moe_eqx.AbstractRouter`][].

        With forced `experts` (routing replay) the selection bias and the group mask
        choose nothing, and the weights are these tokens' scores at the given ids,
        normalised as configured (so the router's weight gets its gradient). A token
        with an id out of `[0, E + I)` or repeated is routed nowhere, like a token
        outside `valid`, and its bad ids are counted in `bad_ids` (concrete ids are
        checked first: a `ValueError`). (A non-finite token still meets the
        router's weight in its matmul: the weight's gradient is NaN in a batch that
        has one. Masking `x` here instead would keep a `[T, d_model]` float32 copy
        alive through the whole layer, which the fallback's memory bound does not
        allow.)
        """
        where = "Router"
        check_array(
            "x", x, shape=(None, self.weight.shape[0]), kind="float", where=where
        )
        if valid is not None:
            check_array("valid", valid, shape=(x.shape[0],), kind="bool", where=where)
        with jax.named_scope("moe_eqx.router"):
            logits, scores, probs, shared = self.scores(x)
            bad_ids = jnp.array(0, jnp.int32)
            if experts is None:
                experts = self.selection(
                    logits,
                    scores,
                    self.bias,
                    top_k=self.top_k,
                    num_groups=self.num_groups,
                    top_groups=self.top_groups,
                )
            else:
                check_expert_ids(
                    experts,
                    x.shape[:-1],
                    top_k=self.top_k,
                    num_experts=self.num_experts,
                    num_identity=self.num_identity,
                )
                experts = experts.astype(jnp.int32)
                bad = bad_expert_ids(experts, scores.shape[-1])
                bad_ids = jnp.sum(bad).astype(jnp.int32)
                ok = ~jnp.any(bad, axis=-1)
                valid = ok if valid is None else valid & ok
                # In range for the gather; the token is routed nowhere below.
                experts = jnp.where(bad, 0, experts)
            chosen = pick_columns(scores, experts)
            weights, shared_weights = self.weighting(
                chosen, shared, normalize=self.norm_topk
            )
            return routing_of(
                experts,
                weights,
                logits,
                probs,
                valid,
                num_experts=self.num_experts,
                num_identity=self.num_identity,
                bad_ids=bad_ids,
                shared_weights=shared_weights,
            )


def routing_of(
    experts: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    logits: Float[Array, "tokens columns"],
    probs: Float[Array, "tokens columns"],
    valid: Bool[Array, " tokens"] | None,
    *,
    num_experts: int,
    num_identity: int = 0,
    bad_ids: Int[Array, ""] | None = None,
    shared_weights: Float[Array, "tokens shared"] | None = None,
) -> Routing:
    """A [`moe_eqx.Routing`][] from a router's choice: the tokens outside `valid`
    routed nowhere, and the counts and losses over the valid ones. For a router of
    your own.

    **Arguments:**

    - `experts`, `weights`: `[T, k]` the chosen experts (`E + j`: identity expert
        `j`) and their weights.
    - `logits`: `[T, E + I]` float32 logits, for the z-loss.
    - `probs`: `[T, E + I]` per-expert scores normalised over the experts, for the
        balance loss.
    - `valid`: optional `[T]` mask of the tokens to route.
    - `num_experts`, `num_identity`: `E` and `I`.
    - `bad_ids`, `shared_weights`: as [`moe_eqx.Routing`][]'s.

    **Returns:**

    The [`moe_eqx.Routing`][].
    """
    z_tokens = jnp.square(jax.nn.logsumexp(logits, axis=-1))
    if valid is None:
        mean_probs = jnp.mean(probs, axis=0)
        z = jnp.mean(z_tokens)
    else:
        nowhere = num_experts + num_identity  # past every expert, identity included
        experts = jnp.where(valid[:, None], experts, nowhere)
        weights = jnp.where(valid[:, None], weights, 0.0)
        n = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
        mean_probs = jnp.sum(jnp.where(valid[:, None], probs, 0.0), axis=0) / n
        z = jnp.sum(jnp.where(valid, z_tokens, 0.0)) / n
    counts = histogram(experts, num_experts)  # identity picks not counted
    # Identity picks are ids E..E+I-1; a masked token's id E+I is in neither.
    identity_counts = histogram(experts - num_experts, num_identity)
    mean_probs = mean_probs[:num_experts]
    return Routing(
        weights=weights.astype(jnp.float32),
        experts=experts.astype(jnp.int32),
        counts=counts,
        mean_probs=mean_probs,
        load_balance_loss=load_balance_loss(counts, mean_probs),
        router_z_loss=z,
        identity_counts=identity_counts,
        bad_ids=jnp.array(0, jnp.int32) if bad_ids is None else bad_ids,
        shared_weights=shared_weights,
    )


def sequence_balance_loss(
    router: Router, x: Float[Array, "*batch seq d_model"]
) -> Float[Array, ""]:
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over sequences.

    For each sequence of `S` tokens: `sum_e f_e * P_e` with
    `f_e = E / (k * S) * #{tokens of the sequence that chose e}` and `P_e` the mean over
    the sequence of the scores normalised over all experts (DeepSeek-V3, eqs. 17-20,
    without the factor `alpha`, which is the caller's coefficient). 1.0 when every
    sequence is perfectly balanced. Multiply by a small `alpha` and add it to the loss.

    The layer's `stats.load_balance_loss` is the batch-wide (Switch) loss
    `E * sum_e f_e P_e` with `f_e` the fraction of pairs routed to `e`; that is
    Hugging Face's `load_balancing_loss_func` divided by `top_k`.

    **Arguments:**

    - `router`: the layer's [`moe_eqx.Router`][] (`layer.router`).
    - `x`: `[..., seq, d_model]`, the tokens the layer sees, with the sequence axis
        second to last.

    **Returns:**

    A float32 scalar, differentiable with respect to the router's weight.
    """
    *batch, seq, d_model = x.shape
    flat = x.reshape(-1, d_model)
    experts = router(flat).experts
    _, _, probs, _ = router.scores(flat)
    num_experts = router.num_experts
    chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=1)
    chosen = chosen.reshape(-1, seq, num_experts)
    f = chosen.sum(axis=1) * (num_experts / (router.top_k * seq))
    p = probs[:, :num_experts].reshape(-1, seq, num_experts).mean(axis=1)
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


def update_router_bias(
    bias: Float[Array, " columns"],
    counts: Int[Array, " experts"],
    *,
    identity_counts: Int[Array, " identity"] | None = None,
    rate: float = 1e-3,
) -> Float[Array, " columns"]:
    """Aux-loss-free balancing update (DeepSeek-V3): raise the selection bias of
    underloaded experts and lower that of overloaded ones by `rate`.

    With identity experts (`config.num_identity_experts`, LongCat-Flash) the bias has
    a column for each of them too, and they are balanced with the routed experts: each
    of the `E + I` columns moves toward the mean load over all of them, so that in
    balance a fraction `E / (E + I)` of the picks goes to routed experts
    (LongCat-Flash: 512 of 768 columns, 8 of its 12 picks on average).

    **Arguments:**

    - `bias`: `[E]` current selection bias (`layer.router.bias`), `[E + I]` with
        identity experts.
    - `counts`: `[E]` pairs per routed expert in the last step (e.g. from
        `stats.expert_counts`).
    - `identity_counts`: `[I]` pairs per identity expert (`stats.identity_counts`);
        needed when the bias has identity columns.
    - `rate`: step size.

    **Returns:**

    The new bias, of `bias`'s shape; apply it with
    `eqx.tree_at(lambda l: l.router.bias, layer, new)`.
    """
    if identity_counts is not None:
        counts = jnp.concatenate([counts, identity_counts.astype(counts.dtype)])
    if bias.shape != counts.shape:
        extra = bias.shape[0] - counts.shape[0]
        hint = (
            f": the {extra} extra columns are identity experts' "
            "(`config.num_identity_experts`), pass their counts as "
            "`identity_counts=stats.identity_counts`"
            if extra > 0 and identity_counts is None
            else ""
        )
        raise ValueError(
            f"`bias` has shape {bias.shape} but the counts have {counts.shape}{hint}."
        )
    load = counts.astype(jnp.float32)
    return bias + jnp.asarray(rate, jnp.float32) * jnp.sign(jnp.mean(load) - load)


def route_tokens(router, x, valid, forced, cfg) -> Routing:
    """`router(x, valid)`, its output checked against the layer's config; with forced
    ids (routing replay) `router(x, valid, experts=...)`, the ids validated here first
    and the routing checked to have used them, whatever the router.

    Forced ids out of `[0, E + I)` or repeated within a token are counted in
    `Routing.bad_ids` (so in `MoEStats.bad_expert_ids`) and their tokens routed
    nowhere: the router gets valid ids (`0..k-1`) for them and a `valid` mask
    without them. A valid token whose routing does not hold its forced experts (a
    router that ignores `experts=`) counts its `k` ids as bad too (`MoELayer` raises
    for them after an eager call).
    """
    if forced is None:
        routing = router(x, valid)
        _check_routing(routing, x, router, cfg)
        return routing
    forced = forced.astype(jnp.int32)
    k = forced.shape[-1]
    bad = bad_expert_ids(forced, cfg.num_experts + cfg.num_identity_experts)
    ok = ~jnp.any(bad, axis=-1)
    valid = ok if valid is None else valid & ok
    safe = jnp.where(ok[:, None], forced, jnp.arange(k, dtype=jnp.int32)[None, :])
    routing = router(x, valid, experts=safe)
    _check_routing(routing, x, router, cfg)
    # The same experts per token, in any order.
    used = jnp.sort(routing.experts.astype(jnp.int32), axis=-1)
    ignored = jnp.any(used != jnp.sort(safe, axis=-1), axis=-1) & valid
    num_ignored = jnp.sum(ignored).astype(jnp.int32)
    count = jnp.sum(bad).astype(jnp.int32) + k * num_ignored
    return eqx.tree_at(lambda r: r.bad_ids, routing, count)


def _check_routing(routing, x, router, cfg) -> None:
    check_routing(
        routing,
        tokens=x.shape[0],
        top_k=cfg.top_k,
        num_experts=cfg.num_experts,
        num_identity=cfg.num_identity_experts,
        router=router,
    )
