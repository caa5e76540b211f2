"""The building blocks under the public stages (as `equinox.internal` is to Equinox):
for tests, benchmarks, and users who assemble their own expert-parallel round trip.
They are documented and tested, but they change more freely than the top level.

- One round trip: `expert_parallel_trip`, `TripInputs`, `TripSpec`, `TripStats`; its
    fallback's chunking, `fallback_chunking`; buffer sizes, `buffer_sizes`,
    `BufferSizes`, `required_buffer_factor`.
- Dispatch and combine: `dedup_rows`, `WireRows`, `send_counts`, `expand_rows`,
    `SortedPairs`, `scatter_to_tokens`, and the gathers with their own transposes
    (`permute_rows`, `unpermute_sum`, `sum_rows`, `inverse_permutation`).
- Exchange: `ExchangePlan`, `make_exchange_plan`, `exchange_name`, `make_exchange`,
    `choose_exchange` (the `"auto"` rule), `expected_wire_rows`,
    `emulate_ragged_all_to_all` (the semantics of `lax.ragged_all_to_all`, for CPU
    tests).
- Experts and grouped matmuls: `expert_ffn`, `gmm_ffn`, `DenseGMM` (the tests'
    one-hot oracle), `resolve_backend`, `auto_backend_name`, the Mosaic GPU backend's
    `MosaicTileConfig`, `autotune_gmm`, `mosaic_gpu_available`.
- Duplication: `assign_destinations`, `slot_pair_counts`, `default_max_exports`,
    `gather_slot_weights`.
- Placement: `physical_routing`, `plan_placement`, `permute_experts`.
- Custom derivatives: `custom_linear` (a linear function with its own transpose,
    which keeps every JAX transformation working), `symbolic_zeros_to_none`.
"""

from ._autodiff import (
    custom_linear as custom_linear,
    symbolic_zeros_to_none as symbolic_zeros_to_none,
)
from ._buffers import BufferSizes as BufferSizes, buffer_sizes as buffer_sizes
from ._combine import scatter_to_tokens as scatter_to_tokens
from ._dispatch import (
    SortedPairs as SortedPairs,
    WireRows as WireRows,
    dedup_rows as dedup_rows,
    expand_rows as expand_rows,
    send_counts as send_counts,
)
from ._exchange import (
    ExchangePlan as ExchangePlan,
    choose_exchange as choose_exchange,
    emulate_ragged_all_to_all as emulate_ragged_all_to_all,
    exchange_name as exchange_name,
    expected_wire_rows as expected_wire_rows,
    make_exchange as make_exchange,
    make_exchange_plan as make_exchange_plan,
)
from ._experts import expert_ffn as expert_ffn, fold_biases as fold_biases
from ._fallback import fallback_chunking as fallback_chunking
from ._gmm import (
    DenseGMM as DenseGMM,
    GradAcc as GradAcc,
    MosaicTileConfig as MosaicTileConfig,
    auto_backend_name as auto_backend_name,
    autotune_gmm as autotune_gmm,
    gmm_ffn as gmm_ffn,
    mosaic_gpu_available as mosaic_gpu_available,
    resolve_backend as resolve_backend,
)
from ._overflow import required_buffer_factor as required_buffer_factor
from ._permute import (
    inverse_permutation as inverse_permutation,
    permute_rows as permute_rows,
    sum_rows as sum_rows,
    unpermute_sum as unpermute_sum,
)
from ._placement import physical_routing as physical_routing
from ._planner import (
    assign_destinations as assign_destinations,
    default_max_exports as default_max_exports,
    slot_pair_counts as slot_pair_counts,
)
from ._qformats import MXFP4 as MXFP4, FP8Blocks as FP8Blocks, Int8 as Int8
from ._quant import quant_formats as quant_formats, quantize as quantize
from ._rebalance import (
    permute_experts as permute_experts,
    plan_placement as plan_placement,
)
from ._slots import gather_slot_weights as gather_slot_weights
from ._trip import (
    TripInputs as TripInputs,
    TripSpec as TripSpec,
    TripStats as TripStats,
    expert_parallel_trip as expert_parallel_trip,
)
