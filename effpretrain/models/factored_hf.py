"""A HuggingFace model class for factorized LLaMA models that have no dense equivalent (CoLA).

`effpretrain export` merges Low-Rank, LoRA, ReLoRA and SLTrain layers into plain Linear weights.
A CoLA layer computes y = B sigma(s A x) + b: no m x n matrix gives that function, so the export
keeps the factors. Its folder is a LLaMA folder whose ``config.json`` has ``model_type``
``effpretrain_factored_llama`` and a ``factor`` entry ({kind, rank, alpha, targets, density,
seed}), and whose weights hold each target's ``A``, ``B`` (and bias) under the target's name
(``model.layers.0.self_attn.q_proj.A``). Load it with::

    import effpretrain.models.factored_hf  # registers the class with the Auto* factories
    model = AutoModelForCausalLM.from_pretrained(folder)

(or `FactoredLlamaForCausalLM.from_pretrained(folder)`). Without the import, transformers refuses
the unknown model type instead of loading a LLaMA with random projection weights.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from effpretrain.models.factorized import apply_factorization

__all__ = ["FactoredLlamaConfig", "FactoredLlamaForCausalLM", "MODEL_TYPE"]

MODEL_TYPE = "effpretrain_factored_llama"


class FactoredLlamaConfig(LlamaConfig):
    """LlamaConfig plus `factor`: the surgery (`apply_factorization` arguments) the model applies."""

    model_type = MODEL_TYPE

    def __init__(self, factor: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.factor = dict(factor or {})
        super().__init__(**kwargs)


class FactoredLlamaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with `config.factor`'s factorization applied on construction, so
    `from_pretrained` finds the factors' parameters where the state dict has them."""

    config_class = FactoredLlamaConfig

    def __init__(self, config: FactoredLlamaConfig) -> None:
        super().__init__(config)
        f = config.factor
        apply_factorization(
            self,
            f["kind"],
            int(f["rank"]),
            float(f["alpha"]),
            targets=tuple(f["targets"]),
            density=float(f.get("density", 0.03)),
            seed=int(f.get("seed", 0)),
        )


AutoConfig.register(MODEL_TYPE, FactoredLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(FactoredLlamaConfig, FactoredLlamaForCausalLM, exist_ok=True)
