"""Export claim: a factorized run exported to a HF folder loads with from_pretrained, same outputs."""

from __future__ import annotations

import pytest
import torch
from _common import ROOT

from effpretrain.checkpoint import load_checkpoint, load_model_weights
from effpretrain.config import ConfigError, load_config
from effpretrain.export import export
from effpretrain.run_model import build_run_model
from effpretrain.trainer import train

SMALL = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "train.batch_size=4",
    "train.eval_tokens=256",
    "train.max_steps=3",
    "train.eval_every=0",
    "train.plot=false",
    "factor.rank=8",
]


@pytest.mark.parametrize(
    "recipe", [pytest.param("lowrank_restarts", marks=pytest.mark.fast), "sltrain", "relora"]
)
@pytest.mark.run
def test_export_round_trips_outputs(recipe, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(ROOT / "recipes" / "tiny" / f"{recipe}.yaml", SMALL + ["restarts.every=2"])
    train(cfg, tmp_path / "run")
    export(tmp_path / "run", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    path = tmp_path / "run" / "checkpoints" / "step-3"
    ours, _ = build_run_model(cfg, 512)
    load_model_weights(ours, load_checkpoint(path)["model"], path)
    ours.eval()
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, hf(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert not any("lora" in n or n.endswith(".A") for n, _ in hf.named_parameters())
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match="not empty"):
        export(tmp_path / "run", tmp_path / "hf")


@pytest.mark.run
@pytest.mark.fast
def test_export_resolves_like_resume(tmp_path):
    # The same resolver as --resume: a missing path, or a run with no complete checkpoint, is bad input.
    with pytest.raises(ConfigError, match=r"^export: .*nope does not exist$"):
        export(tmp_path / "nope", tmp_path / "hf")
    (tmp_path / "run" / "checkpoints" / "step-2.tmp-1").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^export: .*run holds no complete checkpoint$"):
        export(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("recipe", ["cola", pytest.param("cola_m", marks=pytest.mark.fast)])
@pytest.mark.run
def test_export_ships_cola_factors_loadable_with_the_factored_class(recipe, tmp_path):
    """CoLA has no dense weight (y = B silu(A x)): the export keeps A and B under a model type of
    its own, which `effpretrain.models.factored_hf` registers; the loaded model gives our outputs."""
    import json

    from transformers import AutoModelForCausalLM

    from effpretrain.models import FACTOR_KINDS
    from effpretrain.models.factored_hf import MODEL_TYPE, FactoredLlamaForCausalLM

    cfg = load_config(ROOT / "recipes" / "tiny" / f"{recipe}.yaml", SMALL + ["factor.alpha=8"])
    train(cfg, tmp_path / "run")
    export(tmp_path / "run", tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["model_type"] == MODEL_TYPE and saved["architectures"] == ["FactoredLlamaForCausalLM"]
    assert saved["factor"]["kind"] == recipe and saved["factor"]["rank"] == 8
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is FactoredLlamaForCausalLM
    assert type(hf.model.layers[0].mlp.down_proj) is FACTOR_KINDS[recipe].layer
    path = tmp_path / "run" / "checkpoints" / "step-3"
    ours, _ = build_run_model(cfg, 512)
    load_model_weights(ours, load_checkpoint(path)["model"], path)
    ours.eval()
    assert {n for n, _ in hf.named_parameters()} == {n for n, _ in ours.named_parameters()}
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, hf(input_ids=ids).logits
    # Bitwise: the loaded model is built of the same layer classes and holds the same weights, so
    # the same kernels run on the same inputs.
    assert torch.equal(a, b)
