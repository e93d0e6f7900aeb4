"""The factor-kind registry: one `FactorSpec` per `factor.kind`, every per-kind fact."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from effpretrain.models.factorized.cola import CoLALinear, CoLAMLinear
from effpretrain.models.factorized.layers import (
    FactorizedLinear,
    LoRALinear,
    LowRankLinear,
    ReLoRALinear,
    sparse_nnz,
)
from effpretrain.models.factorized.sltrain import SLTrainLinear

logger = logging.getLogger("effpretrain")


@dataclass(frozen=True)
class FactorSpec:
    """Every per-kind fact about a factorization (`factor.kind`), read by config, estimator,
    trainer, leaderboard and tests.

    Attributes:
        name: the registry name (``factor.kind``).
        layer: the FactorizedLinear subclass that replaces a target Linear.
        frozen_dense: keeps the replaced m x n weight as a frozen W0 (LoRA, ReLoRA).
        sparse: adds a fixed random support of nnz = floor(density m n) trainable values and an
            int64 index buffer (SLTrain).
        refactorizable: restarts may rebalance its (B, A) pair (weight refactorization).
        merges_at_restart: restarts merge B A into W0 and re-initialise the factors, resetting only
            their state, with the jagged LR (ReLoRA); this replaces refactorization and reset.
        materializes_dense: the forward forms the dense m x n weight (SLTrain as implemented).
        warm_starts: may train its frozen W0 full rank, factors frozen, for the first
            `factor.warm_start_steps` steps (ReLoRA's warm start); needs `frozen_dense`.
        rank_saves: how many tokens x r tensors its forward saves for backward per layer: 1 for
            the scaled intermediate s (A x) (the second product's input); 0 for SLTrain, whose
            Function saves only x (shared with the block) and its parameters; 2 for CoLA (sigma's
            input and output), 1 for CoLA-M (sigma's input only, its output recomputed).
        dense_equivalent: the layer is linear in x with an m x n weight (`dense_weight`), so export
            can merge it into a plain Linear. False for CoLA (y = B sigma(A x)): export ships the
            factors (effpretrain/export.py).
        pretrained_start: how the surgery starts from a pretrained weight W (`model.init`):
            ``"keep"``: W is the frozen W0 and B = 0 (its usual start), so the model computes the
            source model's function (LoRA, Hu et al. 2021; ReLoRA, Lialin et al. 2023, whose
            method starts from a full-rank warm start); ``"svd"``: B, A from W's truncated SVD with
            sqrt(S) on each side, s B A = U_r S_r V_r^T, the best rank-r approximation (the
            spectral initialisation of Kamalakara et al. 2022); ``""``: the method defines no such
            start, and a run from `model.init` is refused.
    """

    name: str
    layer: type[FactorizedLinear]
    frozen_dense: bool = False
    sparse: bool = False
    refactorizable: bool = True
    merges_at_restart: bool = False
    materializes_dense: bool = False
    warm_starts: bool = False
    rank_saves: int = 1
    dense_equivalent: bool = True
    pretrained_start: str = ""

    def __post_init__(self) -> None:
        if self.warm_starts and not self.frozen_dense:
            raise ValueError(f"factor kind {self.name!r}: warm_starts needs frozen_dense (a W0 to train)")
        if self.refactorizable and not self.dense_equivalent:
            raise ValueError(f"factor kind {self.name!r}: refactorizing needs B A to be the weight")
        if self.pretrained_start not in ("", "keep", "svd"):
            raise ValueError(f"factor kind {self.name!r}: pretrained_start must be '', 'keep' or 'svd'")
        if self.pretrained_start == "keep" and not self.frozen_dense:
            raise ValueError(f"factor kind {self.name!r}: pretrained_start 'keep' needs a frozen W0")

    def param_counts(
        self, m: int, n: int, rank: int, density: float = 0.03, bias: bool = False
    ) -> dict[str, int]:
        """Elements one factorized m x n (out x in) layer holds, without building it.

        trainable = r (m + n) [+ nnz if sparse] [+ m with a bias]; frozen = m n if frozen_dense,
        else 0; index_elements = nnz = floor(density m n) if sparse (int64), else 0.
        """
        nnz = sparse_nnz(m, n, density) if self.sparse else 0
        trainable = rank * (m + n) + (m if bias else 0) + nnz
        return {"trainable": trainable, "frozen": m * n if self.frozen_dense else 0, "index_elements": nnz}

    def flops_per_token(self, m: int, n: int, rank: int, tokens_per_step: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token of one factorized m x n layer.

        Low-rank y = B (A x): 6 r (m + n); a frozen W0 adds 4 m n (no weight gradient); a layer
        that materialises its dense weight costs 6 m n per token plus, once per step, the product
        B A (2 m n r) and its backward (4 m n r), spread over `tokens_per_step` (ignored when None).
        """
        if self.materializes_dense:
            return 6.0 * m * n + (6.0 * m * n * rank / tokens_per_step if tokens_per_step else 0.0)
        return 6.0 * rank * (m + n) + (4.0 * m * n if self.frozen_dense else 0.0)

    def restart_transient_bytes(self, m: int, n: int, rank: int) -> int:
        """Bytes one m x n layer's restart holds at once (fp32): a merge (`merges_at_restart`)
        forms s B A and W0 + s B A (``2 * 4 m n``); a refactorization rebalances B and A through
        fp32 copies and their QR factors (``2 * 4 r (m + n)``); 0 for a kind with neither."""
        if self.merges_at_restart:
            return 8 * m * n
        return 8 * rank * (m + n) if self.refactorizable else 0


FACTOR_KINDS: dict[str, FactorSpec] = {
    s.name: s
    for s in (
        FactorSpec("lowrank", LowRankLinear, pretrained_start="svd"),
        FactorSpec("lora", LoRALinear, frozen_dense=True, pretrained_start="keep"),
        FactorSpec(
            "relora",
            ReLoRALinear,
            frozen_dense=True,
            refactorizable=False,
            merges_at_restart=True,
            warm_starts=True,
            pretrained_start="keep",
        ),
        FactorSpec(
            "sltrain",
            SLTrainLinear,
            sparse=True,
            materializes_dense=True,
            rank_saves=0,
        ),
        FactorSpec("cola", CoLALinear, refactorizable=False, rank_saves=2, dense_equivalent=False),
        FactorSpec("cola_m", CoLAMLinear, refactorizable=False, rank_saves=1, dense_equivalent=False),
    )
}


def pretrained_kinds() -> str:
    """The factor kinds that can start from pretrained weights, as a phrase."""
    return ", ".join(k for k, s in FACTOR_KINDS.items() if s.pretrained_start)


def factor_spec(kind: str) -> FactorSpec:
    """The registry row for `kind`; ValueError naming the choices otherwise."""
    try:
        return FACTOR_KINDS[kind]
    except KeyError:
        raise ValueError(
            f"unknown factorization kind {kind!r}; choose one of {', '.join(FACTOR_KINDS)}"
        ) from None


def factorized_param_counts(
    m: int, n: int, kind: str, rank: int, density: float = 0.03, bias: bool = False
) -> dict[str, int]:
    """Elements one factorized m x n layer of `kind` holds (see `FactorSpec.param_counts`)."""
    return factor_spec(kind).param_counts(m, n, rank, density, bias)
