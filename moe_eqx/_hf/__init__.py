"""Hugging Face MoE models: their configs (`config.py`, read by each family's reader in
`families/`), their blocks' state dicts (`state_dict.py`), their model directories
(`directory.py`) and quantized checkpoints (`quantized.py`), read with one safetensors
reader (`safetensors_file.py`). Nothing is downloaded."""

from .config import config_from_hf as config_from_hf
from .directory import layers_from_hf as layers_from_hf
from .state_dict import layer_from_hf_state_dict as layer_from_hf_state_dict
