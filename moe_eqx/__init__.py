"""moe_eqx: expert-parallel Mixture-of-Experts layers for JAX, built from typed pure
Equinox stages."""

from . import workloads as workloads
from ._combine import combine as combine, scatter_to_tokens as scatter_to_tokens
from ._config import MoEConfig as MoEConfig
from ._dispatch import (
    SortedPairs as SortedPairs,
    WireRows as WireRows,
    dedup_rows as dedup_rows,
    expand_rows as expand_rows,
    send_counts as send_counts,
    sort_by_expert as sort_by_expert,
)
from ._exchange import (
    AbstractExchange as AbstractExchange,
    DenseExchange as DenseExchange,
    ExchangePlan as ExchangePlan,
    RaggedExchange as RaggedExchange,
    make_exchange_plan as make_exchange_plan,
)
from ._experts import (
    Experts as Experts,
    SharedExperts as SharedExperts,
    expert_ffn as expert_ffn,
)
from ._fallback import (
    chunked_dropless as chunked_dropless,
    fallback_chunking as fallback_chunking,
)
from ._gmm import (
    AbstractAccumulatingGMMBackend as AbstractAccumulatingGMMBackend,
    AbstractGMMBackend as AbstractGMMBackend,
    DenseGMM as DenseGMM,
    MosaicGPUGMM as MosaicGPUGMM,
    MosaicTileConfig as MosaicTileConfig,
    RaggedDotGMM as RaggedDotGMM,
    TiledGMM as TiledGMM,
    accumulating_gmm as accumulating_gmm,
    auto_backend_name as auto_backend_name,
    autotune_gmm as autotune_gmm,
    gmm as gmm,
    mosaic_gpu_available as mosaic_gpu_available,
)
from ._hf import layer_from_hf_state_dict as layer_from_hf_state_dict
from ._layer import (
    MoELayer as MoELayer,
    MoEStats as MoEStats,
    reference_moe as reference_moe,
    shard_layer as shard_layer,
    shard_model as shard_model,
    shard_specs as shard_specs,
)
from ._overflow import (
    BufferSizes as BufferSizes,
    buffer_sizes as buffer_sizes,
    overflow_predicate as overflow_predicate,
    required_buffer_factor as required_buffer_factor,
)
from ._planner import (
    DuplicationPlan as DuplicationPlan,
    assign_destinations as assign_destinations,
    default_max_exports as default_max_exports,
    plan_duplication as plan_duplication,
    slot_pair_counts as slot_pair_counts,
)
from ._rebalance import (
    permute_experts as permute_experts,
    physical_routing as physical_routing,
    plan_placement as plan_placement,
    rebalance as rebalance,
    rebalance_experts as rebalance_experts,
)
from ._router import (
    Router as Router,
    Routing as Routing,
    load_balance_loss as load_balance_loss,
    sequence_balance_loss as sequence_balance_loss,
    update_router_bias as update_router_bias,
)
from ._shard import expert_parallel_shard as expert_parallel_shard
from ._slots import gather_slot_weights as gather_slot_weights
from ._trip import (
    TripInputs as TripInputs,
    TripSpec as TripSpec,
    TripStats as TripStats,
    expert_parallel_trip as expert_parallel_trip,
)

__version__ = "0.1.0"
