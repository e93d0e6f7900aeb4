"""Models: LLaMA presets and factorized layers applied by model surgery."""

from effpretrain.models.factorized import (
    FACTORIZED_KINDS,
    LoRALinear,
    LowRankLinear,
    ReLoRALinear,
    SLTrainLinear,
    apply_factorization,
    factor_pairs,
    factorized_layers,
    factorized_param_counts,
    merge_factorized_,
    relora_merge_,
)
from effpretrain.models.llama import (
    PRESETS,
    Preset,
    build_llama_config,
    build_model,
    set_activation_checkpointing,
)

__all__ = [
    "FACTORIZED_KINDS",
    "PRESETS",
    "LoRALinear",
    "LowRankLinear",
    "Preset",
    "ReLoRALinear",
    "SLTrainLinear",
    "apply_factorization",
    "build_llama_config",
    "build_model",
    "factor_pairs",
    "factorized_layers",
    "factorized_param_counts",
    "merge_factorized_",
    "relora_merge_",
    "set_activation_checkpointing",
]
