"""Models: LLaMA presets and factorized layers applied by model surgery."""

from effpretrain.models.llama import PRESETS, Preset, build_llama_config, build_model, set_activation_checkpointing

__all__ = ["PRESETS", "Preset", "build_llama_config", "build_model", "set_activation_checkpointing"]
