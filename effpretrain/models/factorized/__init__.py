"""Factorized linear layers and the model surgery that installs them.

Notation (docs/methods.md): a target Linear computes y = W x + b with W m x n (out x in); r is the
rank, alpha a fixed scale, s = alpha / r. Every layer keeps its factors as B (m x r) and A (r x n).

| layer         | effective weight           | trainable           | frozen | init                           |
|---------------|----------------------------|---------------------|--------|--------------------------------|
| LowRankLinear | s B A                      | B, A: r (m + n)     | -      | B, A Kaiming-uniform           |
| LoRALinear    | W0 + s B A                 | B, A: r (m + n)     | W0: mn | B = 0, A Kaiming, W0 kept      |
| ReLoRALinear  | W0 + s B A, merged every N | B, A: r (m + n)     | W0: mn | as LoRA                        |
| SLTrainLinear | s B A + S (fixed support)  | B, A + S values nnz | -      | B = 0, A Kaiming, S U(+-1/rtn) |
| CoLALinear    | none: y = B sigma(s A x)   | B, A: r (m + n)     | -      | B, A N(0, (r (m + n))^-1/2)    |
| CoLAMLinear   | as CoLA, saves only s A x  | B, A: r (m + n)     | -      | as CoLA                        |

(nnz = floor(delta m n); "rtn" is sqrt(n); SLTrain also holds an int64 index buffer of nnz
elements; a bias, if the original Linear had one, is kept and trained.) "Kaiming-uniform" is
nn.Linear's default init, U(+-1/sqrt(fan_in)): fan_in = n for A and r for B.

Sources: Low-Rank and restarts, Glentis et al. 2025 (the benchmark); LoRA, Hu et al. 2021;
ReLoRA, Lialin et al. 2023; SLTrain, Han et al. 2024; CoLA and CoLA-M, Liu et al. 2025. Two known bugs of public ReLoRA-style code
are avoided by construction: B and A are never both zero-initialised (no gradient would ever
reach either), and the optimizer state is only reset or pruned after B A was merged into W0 (else
the update is lost).

Every layer offers `factor_pair()` -> (B, A) for optimizers.refactorization.refactorize_ (SLTrain's
sparse part is not part of the pair and is left alone) and, except CoLA's (no dense equivalent),
`dense_weight()` -> the m x n effective weight (for export and merging).
"""

from effpretrain.models.factorized.cola import COLA_ACTIVATIONS, CoLALinear, CoLAMLinear
from effpretrain.models.factorized.layers import (
    TARGETS,
    FactorizedLinear,
    LoRALinear,
    LowRankLinear,
    ReLoRALinear,
    sparse_nnz,
)
from effpretrain.models.factorized.registry import (
    FACTOR_KINDS,
    FactorSpec,
    factor_spec,
    factorized_param_counts,
)
from effpretrain.models.factorized.sltrain import SLTrainLinear
from effpretrain.models.factorized.surgery import (
    apply_factorization,
    begin_warm_start_,
    end_warm_start_,
    factor_pairs,
    factorized_layers,
    merge_factorized_,
    relora_merge_,
    warm_start_layers,
    warm_start_params,
    warming_up,
)

__all__ = [
    "COLA_ACTIVATIONS",
    "CoLALinear",
    "CoLAMLinear",
    "FACTOR_KINDS",
    "FactorSpec",
    "FactorizedLinear",
    "LoRALinear",
    "LowRankLinear",
    "ReLoRALinear",
    "SLTrainLinear",
    "TARGETS",
    "apply_factorization",
    "begin_warm_start_",
    "end_warm_start_",
    "factor_pairs",
    "factor_spec",
    "factorized_layers",
    "factorized_param_counts",
    "merge_factorized_",
    "relora_merge_",
    "sparse_nnz",
    "warm_start_layers",
    "warm_start_params",
    "warming_up",
]
