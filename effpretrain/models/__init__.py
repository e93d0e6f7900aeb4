"""Models: LLaMA presets and factorized layers applied by model surgery."""

from effpretrain.models.factorized import (
    FACTOR_KINDS,
    CoLALinear,
    CoLAMLinear,
    FactorSpec,
    LoRALinear,
    LowRankLinear,
    ReLoRALinear,
    SLTrainLinear,
    apply_factorization,
    factor_pairs,
    factor_spec,
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
    "CoLALinear",
    "CoLAMLinear",
    "FACTOR_KINDS",
    "FactorSpec",
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
    "factor_spec",
    "factorized_layers",
    "factorized_param_counts",
    "merge_factorized_",
    "relora_merge_",
    "set_activation_checkpointing",
]
