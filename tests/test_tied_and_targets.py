"""Models beyond the presets' shape (issue 30): tied input and output embeddings are one parameter
with one group entry, one update and one optimizer state; a method's `targets` must name linear
layers, and a method that needs them refuses targets that match nothing, for every family."""

from __future__ import annotations

import copy

import pytest
import torch

import optimizers
from effpretrain.hf import create_optimizer
from effpretrain.models import apply_factorization
from optimizers.momentum_reset import unwrap_optimizer

VOCAB = 300


def _tied_llama(seed: int = 0) -> torch.nn.Module:
    """A tiny LLaMA with grouped-query attention whose head is its input embedding."""
    from effpretrain.models.llama import ModelShape, build_model

    shape = ModelShape(hidden=32, intermediate=64, heads=4, layers=2, vocab=VOCAB, kv_heads=2, tied=True)
    model = build_model(shape, seed=seed)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _gpt2() -> torch.nn.Module:
    """A tiny GPT-2: its attention and MLP layers are transformers' Conv1D (weight in x out)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    cfg.bos_token_id = cfg.eos_token_id = 0
    return GPT2LMHeadModel(cfg)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int = 1) -> None:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_tied_step_equals_torch_adamw_bitwise():
    """One create_optimizer(model, "adamw") step on a tied model equals torch.optim.AdamW over
    model.parameters() bitwise: the tied matrix moves once (it moved twice when it was grouped once
    as the embedding and once as the head). Bitwise because the same kernels run: the factory's
    AdamW is torch's foreach path, which on CPU loops over the per-tensor kernels of the reference's
    single-tensor path, in the same order of operations."""
    ours, ref = _tied_llama(), _tied_llama()
    opt, _ = create_optimizer(ours, "adamw", lr=1e-3, num_training_steps=10, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=opt.param_groups[0]["lr"], weight_decay=0.0)
    for seed in (1, 2):
        _step(ours, opt, seed)
        _step(ref, ref_opt, seed)
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("method", list(optimizers.METHODS))
def test_every_method_groups_and_states_the_tied_matrix_once(method):
    model, extra = _tied_llama(), {}
    if optimizers.method_spec(method).steps_factor_pairs:  # LORO: a factorized model, its period
        apply_factorization(model, "lowrank", rank=4, alpha=4.0)
        extra = {"restarts_every": 5}
    opt, _ = create_optimizer(model, method, lr=1e-3, num_training_steps=10, rank=4, **extra)
    grouped = [id(p) for g in unwrap_optimizer(opt).param_groups for p in g["params"]]
    assert len(grouped) == len(set(grouped)) == sum(1 for p in model.parameters() if p.requires_grad)
    _step(model, opt)
    inner = unwrap_optimizer(opt)
    tied = model.model.embed_tokens.weight
    assert sum(1 for p in inner.state if p is tied) == 1


# One method per family with targets, and the factorization surgery: a Conv1D target is refused,
# naming the module and its type.
FAMILIES = ["adamw", "galore", "apollo_mini", "muon", "scale", "adam_mini", "stable_spam", "adamw_8bit"]


@pytest.mark.parametrize("method", FAMILIES)
def test_a_target_that_is_not_linear_is_refused(method):
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn.*Conv1D.*nn\.Linear"):
        create_optimizer(_gpt2(), method, lr=1e-3, num_training_steps=10, targets=["c_attn"], rank=4)


def test_factorizing_a_target_that_is_not_linear_is_refused():
    model = _gpt2()
    with pytest.raises(ValueError, match=r"c_attn is a transformers\.pytorch_utils\.Conv1D.*nn\.Linear"):
        apply_factorization(model, "lowrank", rank=4, alpha=4.0, targets=["c_attn"])
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"  # nothing replaced


@pytest.mark.parametrize(
    "method, needle",
    [("galore", "matched no linear weight to project"), ("muon", "matched no linear weight to step whole")]
    + [(m, "matched no linear weight to step whole") for m in ("swan", "sinkgd", "scale")],
)
def test_targets_that_match_nothing_are_refused_by_projection_and_whole_matrix_methods(method, needle):
    """GPT-2 has no q_proj ... down_proj: a method that treats its targets differently must not
    silently train every weight with AdamW."""
    with pytest.raises(ValueError, match=needle):
        create_optimizer(_gpt2(), method, lr=1e-3, num_training_steps=10, rank=4)


def test_element_wise_methods_train_a_model_their_targets_do_not_name():
    """AdamW has no targets to honour: the default ones matching nothing on GPT-2 is fine."""
    model = _gpt2()
    opt, _ = create_optimizer(model, "adamw", lr=1e-3, num_training_steps=10)
    before = copy.deepcopy(model.transformer.h[0].attn.c_attn.weight.detach())
    _step(model, opt)
    assert not torch.equal(before, model.transformer.h[0].attn.c_attn.weight)
