"""The training application around the library: a small MoE language model, synthetic
data, the training step and loop, checkpoints, the demo's command line and a
multi-process launcher.

    python -m moe_eqx.demo --help      # the demo (same as python -m moe_eqx.train)

Only the checkpoint functions are exported here; the other modules are imported by
their path (`moe_eqx.train.model`, `moe_eqx.train.loop`, ...).
"""

from .checkpoint import (
    Checkpointer as Checkpointer,
    CheckpointError as CheckpointError,
    list_checkpoints as list_checkpoints,
    load_checkpoint as load_checkpoint,
    read_checkpoint as read_checkpoint,
    read_metadata as read_metadata,
    save_checkpoint as save_checkpoint,
)
