"""moe_eqx: expert-parallel Mixture-of-Experts layers for JAX, built from typed pure
Equinox stages.

The top level holds what users call: the layer and its configuration and stats, the
per-shard entry point and mesh placement, expert re-placement, the stages a user
composes in their own model, the backends, the auxiliary losses and the Hugging Face
import. The building blocks under the stages are in [`moe_eqx.internal`][].
"""

from . import (
    _qformats as _qformats,  # registers the built-in quantized formats
    internal as internal,
    workloads as workloads,
)
from ._activation import (
    GELU as GELU,
    AbstractActivation as AbstractActivation,
    ClampedSwiGLU as ClampedSwiGLU,
    GeGLU as GeGLU,
    ReLU as ReLU,
    ReLU2 as ReLU2,
    SiLU as SiLU,
    SoftcapSwiGLU as SoftcapSwiGLU,
    SwiGLU as SwiGLU,
)
from ._combine import OutputTransform as OutputTransform, combine as combine
from ._config import Execution as Execution, MoEConfig as MoEConfig
from ._dispatch import sort_by_expert as sort_by_expert
from ._exchange import (
    AbstractExchange as AbstractExchange,
    AbstractGatherExchange as AbstractGatherExchange,
    AbstractRowExchange as AbstractRowExchange,
    AllGatherExchange as AllGatherExchange,
    DenseExchange as DenseExchange,
    RaggedExchange as RaggedExchange,
)
from ._experts import (
    ExpertOptions as ExpertOptions,
    Experts as Experts,
    SharedCombination as SharedCombination,
    SharedExperts as SharedExperts,
)
from ._fallback import chunked_dropless as chunked_dropless
from ._gmm import (
    AbstractGMMBackend as AbstractGMMBackend,
    MegabloxGMM as MegabloxGMM,
    MosaicGPUGMM as MosaicGPUGMM,
    PallasTPUGMM as PallasTPUGMM,
    RaggedDotGMM as RaggedDotGMM,
    TiledGMM as TiledGMM,
    gmm as gmm,
)
from ._hash_router import HashRouter as HashRouter
from ._hf import (
    config_from_hf as config_from_hf,
    layer_from_hf_state_dict as layer_from_hf_state_dict,
    layers_from_hf as layers_from_hf,
)
from ._layer import MoELayer as MoELayer
from ._oracle import reference_moe as reference_moe
from ._output import LayerOutput as LayerOutput
from ._overflow import overflow_predicate as overflow_predicate
from ._planner import (
    DuplicationPlan as DuplicationPlan,
    plan_duplication as plan_duplication,
)
from ._qexperts import (
    dequantize_experts as dequantize_experts,
    quantize_experts as quantize_experts,
)
from ._quant import (
    AbstractQuantFormat as AbstractQuantFormat,
    QuantizedArray as QuantizedArray,
    register_quant_format as register_quant_format,
)
from ._rebalance import rebalance as rebalance, rebalance_experts as rebalance_experts
from ._router import (
    AbstractRouter as AbstractRouter,
    Router as Router,
    Routing as Routing,
    load_balance_loss as load_balance_loss,
    routing_of as routing_of,
    sequence_balance_loss as sequence_balance_loss,
    update_router_bias as update_router_bias,
)
from ._scoring import (
    AbstractScore as AbstractScore,
    Selection as Selection,
    Sigmoid as Sigmoid,
    Softmax as Softmax,
    SqrtSoftplus as SqrtSoftplus,
    Weighting as Weighting,
)
from ._shard import expert_parallel_shard as expert_parallel_shard
from ._sharding import shard_model as shard_model, shard_specs as shard_specs
from ._stats import LostPairsError as LostPairsError, MoEStats as MoEStats

__version__ = "0.1.0"
