"""Router stage: scores, top-k selection, routing weights and auxiliary losses."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._config import MoEConfig
from ._rules import histogram


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
        router (`config.shared_in_norm = S`), else `None`.
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


def check_expert_ids(ids, batch_shape: tuple[int, ...], config: MoEConfig) -> None:
    """Forced expert ids (routing replay) fit the tokens and the config, else a
    `TypeError` (not integers) or `ValueError` naming what is wrong. Their values
    are checked where they are concrete; traced ones are counted in the stats
    instead (`MoEStats.bad_expert_ids`).

    **Arguments:**

    - `ids`: the `experts=` argument, `[..., k]`.
    - `batch_shape`: the tokens' leading dimensions (`x.shape[:-1]`).
    - `config`: the layer's [`moe_eqx.MoEConfig`][].
    """
    dtype = getattr(ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"`experts` (forced expert ids) must be an integer array, got dtype {dtype}."
        )
    want = (*batch_shape, config.top_k)
    if tuple(ids.shape) != want:
        raise ValueError(
            f"`experts` (forced expert ids) must have shape {want} (the tokens' "
            f"leading dimensions, then `config.top_k`), got {tuple(ids.shape)}."
        )
    if isinstance(ids, jax.core.Tracer) or ids.size == 0:
        return
    columns = config.num_experts + config.num_identity_experts
    flat = jnp.asarray(ids).reshape(-1, config.top_k)
    bad = bad_expert_ids(flat, columns)
    if bool(jnp.any(bad)):
        tokens = jnp.nonzero(jnp.any(bad, axis=-1))[0]
        first = int(tokens[0])
        raise ValueError(
            f"`experts` (forced expert ids) must be distinct per token and in "
            f"[0, {columns}) (`num_experts` {config.num_experts} + "
            f"`num_identity_experts` {config.num_identity_experts}): "
            f"{int(jnp.sum(bad))} bad ids in {tokens.size} tokens, the first at "
            f"token {first} (flattened): {flat[first].tolist()}."
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


class Router(eqx.Module):
    """Linear router with softmax, sigmoid or `sqrt(softplus)` scores and
    (group-limited) top-k selection.

    `logits = x @ weight (+ logit_bias)` in float32 (soft-capped, `c * tanh(logits /
    c)`, with `c = config.router_softcap > 0`), with `weight [d_model, E + I]`
    and the optional `bias` and `logit_bias` `[E + I]`: the routed experts' columns,
    then those of the `I = config.num_identity_experts` identity experts (0 unless
    set). The optional `logit_bias`
    (`config.router_logit_bias`, GPT-OSS) is a trained parameter of the logits. The
    optional `bias` only changes which experts are selected (aux-loss-free balancing):
    the top-k of `scores + bias`, or of `logits + bias` with `config.bias_on_logits`
    (Kolibri-1), never the weights; it receives no gradient, and [`moe_eqx.update_router_bias`][]
    is the rule to update it.

    Group-limited routing (`num_groups > 1`): a group's score is the sum of its best
    `min(2, experts per group)` selection scores (DeepSeek-V3), or with
    `group_score="max"` its best one (DeepSeek-V2); each token chooses its `top_k`
    experts among the experts of its `top_groups` best groups (the others' selection
    scores replaced by `config.group_fill`, `-inf` unless set).

    **Fields:**

    - `weight`: `[d_model, E + I + S]` (`I = config.num_identity_experts`; the last
        `S = config.shared_in_norm` columns score the shared experts, Inkling).
    - `bias`: `[E + I]` selection bias with `config.use_router_bias`, else `None`.
    - `config`: the [`moe_eqx.MoEConfig`][] whose routing settings (`top_k`,
        `score_func`, `norm_topk`, `norm_topk_min`, `num_groups`, `top_groups`,
        `group_score`, `group_fill`, `num_identity_experts`) it computes; they read
        as attributes too (`router.top_k`).
    - `logit_bias`: `[E + I]` with `config.router_logit_bias`, else `None`.
    """

    weight: Float[Array, "d_model columns"]
    bias: Float[Array, " experts"] | None
    config: MoEConfig
    logit_bias: Float[Array, " experts"] | None = None

    def __init__(self, config: MoEConfig, *, key: PRNGKeyArray):
        scale = 1.0 / (config.d_model**0.5)
        # Identity experts (LongCat-Flash) are the last `num_identity` columns.
        columns = config.num_experts + config.num_identity_experts
        self.config = config
        self.weight = scale * jr.normal(
            key, (config.d_model, columns + config.shared_in_norm), jnp.float32
        )
        self.bias = (
            jnp.zeros((columns,), jnp.float32) if config.use_router_bias else None
        )
        self.logit_bias = (
            jnp.zeros((columns,), jnp.float32) if config.router_logit_bias else None
        )

    # The routing settings, read from `config` (not copied: one value per setting).
    @property
    def num_experts(self) -> int:
        """`E`, the routed experts (identity experts not counted)."""
        return self.config.num_experts

    @property
    def num_identity(self) -> int:
        return self.config.num_identity_experts

    @property
    def top_k(self) -> int:
        return self.config.top_k

    @property
    def score_func(self) -> str:
        return self.config.score_func

    @property
    def norm_topk(self) -> bool:
        return self.config.norm_topk

    @property
    def num_groups(self) -> int:
        return self.config.num_groups

    @property
    def top_groups(self) -> int:
        return self.config.top_groups

    @property
    def group_score(self) -> str:
        return self.config.group_score

    def _group_mask(self, select: Float[Array, "tokens experts"]) -> Array:
        tokens, num_experts = select.shape
        per_group = num_experts // self.num_groups
        grouped = select.reshape(tokens, self.num_groups, per_group)
        best = jax.lax.top_k(
            grouped, 1 if self.group_score == "max" else min(2, per_group)
        )[0]
        group_scores = jnp.sum(best, axis=-1)
        _, top_group_idx = jax.lax.top_k(group_scores, self.top_groups)
        group_ok = jnp.zeros((tokens, self.num_groups), bool)
        group_ok = group_ok.at[jnp.arange(tokens)[:, None], top_group_idx].set(True)
        return jnp.repeat(group_ok, per_group, axis=1)

    def _scores(self, x):
        """`(logits, scores, probs, shared)`: float32 logits, the scores the weights
        come from (softmax, sigmoid or sqrt-softplus), the scores normalised over all
        experts, and the `[T, S]` scores of the shared experts the router scores
        (`config.shared_in_norm`; else `None`)."""
        logits = jnp.dot(
            x.astype(jnp.float32),
            self.weight.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        if self.logit_bias is not None:
            logits = logits + self.logit_bias.astype(jnp.float32)[None, :]
        cap = self.config.router_softcap
        if cap > 0:  # Laguna's soft-capping
            logits = jnp.float32(cap) * jnp.tanh(logits / jnp.float32(cap))
        if self.score_func == "softmax":  # never with `shared_in_norm` (the config)
            scores = jax.nn.softmax(logits, axis=-1)
            return logits, scores, scores, None
        if self.score_func == "sigmoid":
            scores = jax.nn.sigmoid(logits)
        else:  # "sqrtsoftplus" (DeepSeek-V4)
            scores = jnp.sqrt(jax.nn.softplus(logits))
        shared = None
        num_shared = self.config.shared_in_norm
        if num_shared:  # the shared experts' columns are last
            logits, scores, shared = (
                logits[:, :-num_shared],
                scores[:, :-num_shared],
                scores[:, -num_shared:],
            )
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        return logits, scores, probs, shared

    def __call__(
        self,
        x: Float[Array, "tokens d_model"],
        valid: Bool[Array, " tokens"] | None = None,
        *,
        experts: Int[Array, "tokens k"] | None = None,
    ) -> Routing:
        """Routes tokens to experts.

        **Arguments:**

        - `x`: `[T, d_model]` token activations.
        - `valid`: optional `[T]` mask; a token outside it (a non-finite or padding
            token) is routed nowhere: its pairs get expert id `E +
            num_identity` and weight 0, and it counts in no statistic (`counts`,
            `mean_probs` and the losses are over the valid tokens). (A non-finite
            token still meets the router's weight in its matmul: the weight's
            gradient is NaN in a batch that has one. Masking `x` here instead
            would keep a `[T, d_model]` float32 copy alive through the whole
            layer, which the fallback's memory bound does not allow.)
        - `experts`: optional `[T, k]` int forced expert ids (routing replay), used
            instead of the top-k selection: the selection bias and the group mask
            choose nothing, and the weights are these tokens' scores at the given ids,
            normalised as configured (so the router's weight gets its gradient).
            `E + j` is identity expert `j`. A token with an id out of `[0, E + I)` or
            repeated is routed nowhere, like a token outside `valid`, and its bad ids
            are counted in `bad_ids` (concrete ids are checked first: a
            `ValueError`).

        **Returns:**

        A [`moe_eqx.Routing`][].
        """
        with jax.named_scope("moe_eqx.router"):
            logits, scores, probs, shared = self._scores(x)
            bad_ids = jnp.array(0, jnp.int32)
            if experts is None:
                experts = self._select(logits, scores)
            else:
                check_expert_ids(experts, x.shape[:-1], self.config)
                experts = experts.astype(jnp.int32)
                bad = bad_expert_ids(experts, scores.shape[-1])
                bad_ids = jnp.sum(bad).astype(jnp.int32)
                ok = ~jnp.any(bad, axis=-1)
                valid = ok if valid is None else valid & ok
                # In range for the gather; the token is routed nowhere below.
                experts = jnp.where(bad, 0, experts)
            chosen = jnp.take_along_axis(scores, experts, axis=-1)
            shared_weights = shared
            if self.norm_topk:
                total = jnp.sum(chosen, axis=-1, keepdims=True)
                if shared is not None:  # one denominator for routed and shared
                    total = total + jnp.sum(shared, axis=-1, keepdims=True)
                if self.config.norm_topk_min > 0:  # ERNIE-4.5's `moe_norm_min`
                    total = jnp.maximum(total, self.config.norm_topk_min)
                weights = chosen / total
                if shared is not None:
                    shared_weights = shared / total
            else:
                weights = chosen
            num_experts = self.num_experts
            z_tokens = jnp.square(jax.nn.logsumexp(logits, axis=-1))
            if valid is None:
                mean_probs = jnp.mean(probs, axis=0)
                z = jnp.mean(z_tokens)
            else:
                # Past every expert, identity included.
                nowhere = num_experts + self.num_identity
                experts = jnp.where(valid[:, None], experts, nowhere)
                weights = jnp.where(valid[:, None], weights, 0.0)
                n = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
                mean_probs = jnp.sum(jnp.where(valid[:, None], probs, 0.0), axis=0) / n
                z = jnp.sum(jnp.where(valid, z_tokens, 0.0)) / n
            counts = histogram(experts, num_experts)  # identity picks not counted
            # Identity picks are ids E..E+I-1; a masked token's id E+I is in neither.
            identity_counts = histogram(experts - num_experts, self.num_identity)
            mean_probs = mean_probs[:num_experts]
            lb = load_balance_loss(counts, mean_probs)
            return Routing(
                weights=weights,
                experts=experts,
                counts=counts,
                mean_probs=mean_probs,
                load_balance_loss=lb,
                router_z_loss=z,
                identity_counts=identity_counts,
                bad_ids=bad_ids,
                shared_weights=shared_weights,
            )

    def _select(
        self,
        logits: Float[Array, "tokens experts"],
        scores: Float[Array, "tokens experts"],
    ) -> Int[Array, "tokens k"]:
        """The top-k experts by score (plus the selection bias), within the best
        groups with group-limited routing."""
        # Scores are monotone in the logits: selecting on either is the same but for
        # the bias (Kolibri-1 adds it to the logits).
        select = jax.lax.stop_gradient(logits if self.config.bias_on_logits else scores)
        if self.bias is not None:
            select = select + jax.lax.stop_gradient(self.bias)[None, :]
        if self.num_groups > 1:
            fill = jnp.float32(self.config.group_fill)
            select = jnp.where(self._group_mask(select), select, fill)
        _, experts = jax.lax.top_k(select, self.top_k)
        return experts.astype(jnp.int32)


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
    _, _, probs, _ = router._scores(flat)
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
