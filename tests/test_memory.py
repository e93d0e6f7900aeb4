"""Memory estimator claims: shapes equal the real model's, paper numbers, checkpointing, sharding."""

from __future__ import annotations

import math

import pytest
import torch
from _common import ROOT, child_env

import optimizers
from effpretrain.memory import (
    PRECISIONS,
    checkpointed_layers,
    estimate,
    estimate_from_config,
    model_param_shapes,
)
from effpretrain.models import build_model


@pytest.mark.parametrize("preset", ["tiny", "llama_20m"])
def test_meta_model_shapes_equal_the_real_model(preset):
    model = build_model(preset, vocab_size=1000, max_positions=64)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    shapes = model_param_shapes(preset, 1000)
    assert real == [(s.name, s.shape) for s in shapes]
    linears = {
        f"{n}.weight": n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    assert {s.name: s.linear for s in shapes if s.linear is not None} == linears
    assert len(linears) == 7 * len(model.model.layers) + 1  # the attention/MLP targets and lm_head


def test_precision_names_are_the_configs():
    from effpretrain.config import PRECISIONS as CONFIG_PRECISIONS
    from effpretrain.config import load_config

    assert tuple(PRECISIONS) == CONFIG_PRECISIONS  # one set of names for config and estimator
    cfg = load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", [])
    by_name = {}
    for name in PRECISIONS:
        cfg.train.precision = name
        by_name[name] = estimate_from_config(cfg, 512)
        assert by_name[name].detail["dtype"] == name
    assert by_name["fp32"].weights == by_name["bf16-mixed"].weights == 2 * by_name["bf16-pure"].weights
    # bf16-pure halves every saved tensor but the fp32 ones (norm inputs, rsqrt, logsumexp, log-softmax);
    # bf16-mixed keeps an fp32 residual stream plus bf16 casts (test_activations_equal_saved_bytes).
    assert by_name["bf16-pure"].activations < by_name["bf16-mixed"].activations
    assert by_name["bf16-pure"].activations < by_name["fp32"].activations
    with pytest.raises(
        ValueError, match="unknown precision 'bf16'; choose one of fp32, bf16-mixed, bf16-pure"
    ):
        estimate("tiny", dtype="bf16")


@pytest.mark.parametrize(
    "preset, params_m",
    [("llama_60m", 58.07), ("llama_130m", 134.1), ("llama_350m", 367.97), ("llama_1b", 1339.08)],
)
def test_paper_sizes_param_counts(preset, params_m):
    assert estimate(preset).params / 1e6 == pytest.approx(params_m, abs=0.05)


@pytest.mark.parametrize(
    "preset, gb", [("llama_60m", 0.35), ("llama_130m", 0.81), ("llama_350m", 2.21), ("llama_1b", 8.04)]
)
def test_adamw_weights_plus_state_match_paper_table(preset, gb):
    est = estimate(preset, "adamw", dtype="bf16-pure")
    assert est.weights_plus_optimizer / 1e9 == pytest.approx(gb, abs=0.01)


def test_adamw_formula_is_exact_per_param():
    est = estimate("tiny", "adamw", dtype="fp32", vocab_size=512)
    n_tensors = len(model_param_shapes("tiny", 512))
    # two fp32 moments per element + torch's float32 step scalar per tensor
    assert est.optimizer_state == 2 * 4 * est.params + 4 * n_tensors
    assert est.weights == est.grads == 4 * est.params


def test_activation_checkpointing_and_sharding_reduce_memory():
    full = estimate("llama_60m", batch_size=8, seq_len=256)
    ck = estimate("llama_60m", batch_size=8, seq_len=256, activation_checkpointing=1)
    ck2 = estimate("llama_60m", batch_size=8, seq_len=256, activation_checkpointing=2)
    assert ck.activations < ck2.activations < full.activations
    sharded = estimate("llama_1b", world_size=8, sharding="fsdp2")
    one = estimate("llama_1b")
    # Rank 0's share: ceil(rows / 8) rows of each tensor, a little over an eighth (5461-row MLPs).
    assert -(-one.weights // 8) <= sharded.weights <= 1.001 * one.weights / 8
    assert -(-one.optimizer_state // 8) <= sharded.optimizer_state <= 1.001 * one.optimizer_state / 8
    ddp = estimate("llama_1b", world_size=8, sharding="ddp")
    assert ddp.weights == one.weights


def test_bf16_halves_weights():
    assert estimate("tiny", dtype="bf16-pure").weights * 2 == estimate("tiny", dtype="fp32").weights
    assert torch.finfo(torch.bfloat16).bits == 16


@pytest.mark.parametrize(
    "preset, method, rank, target, tol",
    [
        ("llama_1b", "galore", 512, 4.76e9, 0.005),  # issue acceptance, paper 4.76 GB
        ("llama_60m", "galore", 128, 0.28e9, 0.02),  # paper 0.28 GB (two decimals)
        ("llama_130m", "galore", 256, 0.61e9, 0.01),
        ("llama_1b", "lowrank", 512, 3.66e9, 0.01),  # paper ~3.66 GB
    ],
)
def test_weights_plus_state_match_paper(preset, method, rank, target, tol):
    from effpretrain.config import OptimConfig

    if method == "lowrank":
        est = estimate(preset, "adamw", dtype="bf16-pure", factor_kind="lowrank", factor_rank=rank)
    else:
        est = estimate(preset, method, dtype="bf16-pure", optim_cfg=OptimConfig(name=method, rank=rank))
    assert abs(est.weights_plus_optimizer - target) / target <= tol


@pytest.mark.parametrize(
    "method, target",
    [
        # Issue 18's acceptance figures (OptimAI-Lab/Minimalist_LLM_Pretraining README, 1B, bf16).
        ("swan", 3.20e9),  # AdamW on embeddings, head, vectors; hidden matrices stateless
        ("scale", 2.81e9),  # momentum on the LM head only, AdamW on vectors
        # Muon as implemented (momentum on hidden matrices, AdamW on embeddings, head, vectors, as
        # Muon and torch.optim.Muon prescribe). The README's 5.36 GB is exactly twice the weights,
        # i.e. one buffer for every parameter, embeddings and head included: our figure is 4.8% above.
        ("muon", 5.62e9),
    ],
)
def test_whole_matrix_methods_weights_plus_state_match_paper(method, target):
    est = estimate("llama_1b", method, dtype="bf16-pure")
    assert abs(est.weights_plus_optimizer - target) / target <= 0.01
    if method == "muon":  # the README's figure is weights + one bf16 buffer per parameter
        assert est.weights_plus_optimizer > 1.04 * 2 * est.weights


def test_whole_matrix_state_is_owner_placed_under_fsdp2():
    """Muon's and SCALE's whole-matrix state sits on owner ranks: the ranks' state adds up to one
    process's (less the AdamW step scalars, none here), and no rank holds more than 1/N of it plus
    the largest single matrix's."""
    for method in ("muon", "scale"):
        one = estimate("llama_1b", method, dtype="bf16-pure")
        est = estimate("llama_1b", method, dtype="bf16-pure", world_size=8, sharding="fsdp2")
        per_rank = est.detail["optimizer_state_per_rank"]
        assert sum(per_rank) == one.optimizer_state
        largest = 32000 * 2048 * 2  # the head's momentum (SCALE), larger than any hidden matrix's
        assert max(per_rank) <= one.optimizer_state / 8 + largest


def test_galore_state_formula_by_hand():
    """GaLore per projected m x n matrix: basis min(m,n) x r + two moments r x max(m,n) (Zhao et al. 2024)."""
    from effpretrain.config import OptimConfig

    h, i, r, V, L = 512, 1376, 128, 32000, 8
    per_layer = 4 * (h * r + 2 * r * h) + 3 * (h * r + 2 * r * i)
    others = 2 * (2 * V * h + (2 * L + 1) * h)  # AdamW moments of embeddings, head, norms
    est = estimate("llama_60m", "galore", dtype="bf16-pure", optim_cfg=OptimConfig(name="galore", rank=r))
    assert est.optimizer_state == 2 * (L * per_layer + others)


def test_fsdp2_per_rank_bytes_by_hand():
    """llama_1b, GaLore r512, 8 ranks, FSDP2, bf16: weights, grads and the full-rank AdamW state of
    embeddings/head/norms are sharded by rows (torch.chunk: ceil(rows / 8) on the first ranks);
    each projected matrix's basis + low-rank moments live on one owner rank. Its 24 layers x 7
    matrices are 96 attention matrices (state 3 h r each) and 72 MLP matrices (2 i r + h r): 12
    and 9 per rank, so every rank holds an eighth of the projected state."""
    from effpretrain.config import OptimConfig

    h, i, r, V, L, W = 2048, 5461, 512, 32000, 24, 8
    rows = lambda n, k: max(0, min(-(-n // W), n - k * -(-n // W)))  # noqa: E731 - rank k's rows
    c = lambda n: rows(n, 0)  # noqa: E731 - rank 0's rows
    # embed + head (V x h), per layer q/k/v/o (h x h), gate/up (i x h), down (h x i), 2 norms, final norm
    mine = 2 * c(V) * h + L * (4 * c(h) * h + 2 * c(i) * h + c(h) * i + 2 * c(h)) + c(h)
    proj_state = L * (4 * (h * r + 2 * r * h) + 3 * (h * r + 2 * r * i))  # elements, bf16
    dense = [2 * (2 * rows(V, k) * h + (2 * L + 1) * rows(h, k)) for k in range(W)]  # two moments
    est = estimate(
        "llama_1b",
        "galore",
        dtype="bf16-pure",
        optim_cfg=OptimConfig(name="galore", rank=r),
        world_size=W,
        sharding="fsdp2",
    )
    assert est.weights == est.grads == 2 * mine
    per_rank = est.detail["optimizer_state_per_rank"]
    assert per_rank == [2 * d + 2 * proj_state // W for d in dense]
    assert est.optimizer_state == max(per_rank) <= 0.30e9  # was 1.6e9 with the state on every rank


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize(
    "method", ["galore", "apollo_mini", "galore_8bit", "adamw_8bit", "adam_mini", "adamw_4bit", "galore_4bit"]
)
def test_fsdp2_state_per_rank_shrinks_with_ranks(method, world):
    """Whole-matrix state is placed on owner ranks: no rank holds more than total / N plus the
    largest single parameter's state, for the projected and the 8-bit methods alike."""
    from effpretrain.config import OptimConfig

    cfg = OptimConfig(name=method, rank=512)
    one = estimate("llama_1b", method, dtype="bf16-pure", optim_cfg=cfg)
    many = estimate("llama_1b", method, dtype="bf16-pure", optim_cfg=cfg, world_size=world, sharding="fsdp2")
    from effpretrain.memory import model_param_shapes, projection_group

    spec, group = (
        optimizers.METHODS[method],
        projection_group(cfg) if optimizers.METHODS[method].projects else {},
    )
    largest = max(
        spec.state_bytes(s.shape, group if s.linear and spec.projects else {}, torch.bfloat16)
        for s in model_param_shapes("llama_1b")
    )
    assert max(many.detail["optimizer_state_per_rank"]) <= one.optimizer_state / world + largest
    assert sum(many.detail["optimizer_state_per_rank"]) <= one.optimizer_state + world * 2 * 4 * 256


# ----------------------------------------------------------------------------------------------
# The peak model, checked against measured tensors (effpretrain.memory.measure.measure_step).

RECIPES = sorted((ROOT / "recipes" / "tiny").glob("*.yaml"))


def _saved_activation_bytes(model, fn):
    """Bytes autograd saves for backward during `fn()`, each storage once, parameters and buffers
    excluded (they are weights, not activations)."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _measured_run(cfg, vocab_size, steps=2):
    """The run's model and optimizer built as the trainer does, `steps` steps measured: the one
    with the largest peak (from the second step the optimizer state exists before the forward)."""
    from effpretrain.memory.measure import measure_run

    return max(measure_run(cfg, vocab_size, steps), key=lambda r: r["peak"])


def _check_against_measured(recipe, overrides, rel_peak=0.05):
    from effpretrain.config import load_config

    # The step measured here draws no data: no shuffle pool (the trainer's runs count it, `data_bytes`).
    cfg = load_config(recipe, [*overrides, "data.shuffle_buffer=0"])
    est = estimate_from_config(cfg, cfg.data.vocab_size)
    measured = _measured_run(cfg, cfg.data.vocab_size)
    # Weights, gradients and optimizer state are exact (state shared by all parameters, 8-bit
    # AdamW's quantile maps, counted once on both sides), activations too (the formula counts what
    # HF LLaMA, SDPA and the factorized layers save); the peak within a few percent (temporaries).
    assert measured["weights"] == est.weights
    assert measured["gradients"] == est.grads
    assert measured["optimizer_state"] == est.optimizer_state
    assert measured["activations"] == pytest.approx(est.activations, rel=0.01)
    assert measured["peak"] == pytest.approx(est.peak, rel=rel_peak), est.detail["peak_terms"]
    return est, measured


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-pure"])
@pytest.mark.parametrize("recipe", ["adamw", "lowrank", "lora", "sltrain", "cola", "cola_m"])
@pytest.mark.parametrize("checkpointing", [0, 1, [1, 3]])
def test_activations_equal_saved_bytes(precision, recipe, checkpointing):
    """Exact: the activation formula per precision, factorization and checkpointing equals the
    bytes autograd saves in a forward of the real model."""
    from effpretrain.config import load_config
    from effpretrain.loss import token_loss_sum
    from effpretrain.models import set_activation_checkpointing
    from effpretrain.run_model import build_run_model

    over = ["train.batch_size=2", "data.seq_len=16", f"train.precision={precision}"]
    cfg = load_config(ROOT / "recipes" / "tiny" / f"{recipe}.yaml", over)
    V = cfg.data.vocab_size
    model, _ = build_run_model(cfg, V)
    set_activation_checkpointing(model, checkpointing)
    if precision == "bf16-pure":
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, V, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def forward():
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            token_loss_sum(
                model, batch, packed=True, loss=cfg.train.loss, chunk_tokens=cfg.train.loss_chunk_tokens
            )

    est = estimate_from_config(cfg, V, checkpointed=checkpointed_layers(checkpointing, 4))
    assert _saved_activation_bytes(model, forward) == est.activations


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_tiny_recipe_peak_matches_measured(recipe):
    """Every tiny recipe (fp32, CPU; batch 4 to keep it short, the formula is linear in tokens):
    activations and the peak (a backward moment: the logits' loss terms) as measured."""
    est, measured = _check_against_measured(recipe, ["train.batch_size=4"])
    # The standard loss peaks in its backward (the (N, V) gradients); the chunked loss (the
    # default) at the end of its forward, where it has formed dH and dW beside the activations.
    moment = {"forward_end": "forward", "loss_backward": "backward"}[est.detail["peak_moment"]]
    assert est.detail["peak_phase"] == "forward_backward" and measured["phase_at_peak"] == moment


@pytest.mark.parametrize("recipe", ["adamw", "galore", "lowrank_restarts", "sltrain"])
def test_llama_20m_peak_matches_measured(recipe):
    """A wider model than tiny (llama_20m: hidden 256, MLP 688) at batch 4: weights, gradients,
    state and activations as measured, the peak within 5%, for a dense, a projected, a factorized
    and a sparse-plus-low-rank method. (At the recipes' own batch: the slow test below and
    benchmarks/results/memory.json.)"""
    _check_against_measured(
        ROOT / "recipes" / "tiny" / f"{recipe}.yaml", ["model.preset=llama_20m", "train.batch_size=4"]
    )


@pytest.mark.parametrize(
    "recipe",
    [
        "adamw",
        "galore",
        "galore_8bit",
        "fira",
        "apollo",
        "stable_spam",
        "relora",
        "golore",
        "adam_mini",
        "adamw_4bit",
        "galore_4bit",
    ],
)
def test_optimizer_step_peak_matches_measured(recipe):
    """One short sequence: the optimizer step is the largest moment, with each method's step
    transients (`MethodSpec.step_transient_bytes`). (adamw_8bit's fused kernel has none: its step
    stays below its backward, checked by the recipe test below.)"""
    path = ROOT / "recipes" / "tiny" / f"{recipe}.yaml"
    est, measured = _check_against_measured(path, ["train.batch_size=1", "data.seq_len=16"])
    assert est.detail["peak_phase"] == measured["phase_at_peak"] == "optimizer_step"


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, preset",
    [(p.stem, "tiny") for p in RECIPES]
    + [(r, "llama_20m") for r in ("adamw", "galore", "lowrank_restarts", "sltrain")],
)
def test_recipe_shapes_peak_matches_measured(recipe, preset):
    """Issue 15 acceptance 1 (estimate side), at the recipes' own batch: every tiny recipe and
    llama_20m with adamw, galore, lowrank_restarts and sltrain."""
    _check_against_measured(ROOT / "recipes" / "tiny" / f"{recipe}.yaml", [f"model.preset={preset}"])


@pytest.mark.parametrize("loss", ["standard", "chunked"])
def test_grad_accum_holds_gradients_through_the_forward(loss):
    # chunked: the head's gradient is the dW its loss saved in the forward; held across the
    # micro-steps it is a gradient, not an activation of the next micro-step.
    _check_against_measured(
        ROOT / "recipes" / "tiny" / "adamw.yaml",
        ["train.batch_size=2", "train.grad_accum=2", f"train.loss={loss}"],
    )
    one = estimate("tiny", "adamw", dtype="fp32", batch_size=2, seq_len=128)
    two = estimate("tiny", "adamw", dtype="fp32", batch_size=2, seq_len=128, grad_accum=2)
    assert two.peak - one.peak == one.grads


def test_loss_terms_by_hand():
    """Standard: (N, V) logits + fp32 log-softmax; chunked: dH and dW held (4 N h + 4 V h), the
    transient of `effpretrain.loss.loss_bytes` (its own measured formula) plus the shifted labels.
    8192 tokens, V 32000, h 256, C 1024, bf16 activations."""
    from effpretrain import loss as loss_mod
    from effpretrain.memory import loss_bytes

    N, V, h, C = 8192, 32000, 256, 1024
    std = loss_bytes("standard", N, V, h, torch.bfloat16)
    assert std.saved == 4 * N * V + 8 * N + 4
    assert std.forward == 2 * N * V + 4 * N * V  # bf16 logits and their fp32 copy
    # Issue 15: at llama_1b's micro-batch 32 x 256, vocabulary 32,000, about 2.6 GB at once.
    assert std.saved + std.forward == pytest.approx(2.62e9, rel=0.005)
    chunked = loss_bytes("chunked", N, V, h, torch.bfloat16, chunk=C)
    own = loss_mod.loss_bytes("chunked", N, V, h, torch.bfloat16, chunk_tokens=C)
    assert chunked.saved == own["saved"] == 4 * N * h + 4 * V * h
    assert chunked.forward == own["transient"] + 8 * N and chunked.backward == 0
    assert (chunked.saved + chunked.forward) <= 0.2 * (std.saved + std.forward)
    with pytest.raises(ValueError, match="unknown loss kind 'fused'"):
        loss_bytes("fused", N, V, h, torch.float32)


def test_ddp_buckets_and_fsdp2_gathers():
    """DDP: the buckets hold one full gradient from the start; with gradient_as_bucket_view (the
    trainer's) the gradients are those buckets, so the optimizer step's peak equals one process's;
    without it one more full gradient. FSDP2: rank 0's shards plus the gathered root (the final
    norm), two decoder layers and, at the loss, the head (an untied model's embedding and head are
    units of their own, `effpretrain.fsdp.edge_units`)."""
    kw = dict(dtype="fp32", batch_size=1, seq_len=16)
    one = estimate("llama_20m", "adamw", **kw)
    view = estimate("llama_20m", "adamw", world_size=2, sharding="ddp", **kw)
    copy = estimate("llama_20m", "adamw", world_size=2, sharding="ddp", ddp_bucket_view=False, **kw)
    assert one.detail["peak_moment"] == view.detail["peak_moment"] == "optimizer_step"
    assert view.peak == one.peak and view.detail["peak_terms"]["ddp_buckets"] == one.grads
    assert copy.peak == one.peak + one.grads
    fsdp = estimate(
        "llama_20m", "adamw", world_size=2, sharding="fsdp2", batch_size=8, seq_len=256, dtype="fp32"
    )
    V, h, i = 32000, 256, 688
    layer = 4 * (4 * h * h + 3 * h * i + 2 * h)
    norm, head = 4 * (h - h // 2), 4 * (V * h - (V // 2) * h)  # unsharded: whole less rank 0's shard
    assert fsdp.detail["peak_moment"] in ("forward_end", "loss_backward")
    assert fsdp.detail["peak_terms"]["fsdp_gather"] == norm + 2 * (layer - layer // 2) + head


def _llama_20m_auto(budget_gb):
    from effpretrain.config import load_config

    over = [
        "model.preset=llama_20m",
        "train.activation_checkpointing=auto",
        f"train.memory_budget_gb={budget_gb}",
    ]
    return load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", over)


@pytest.mark.parametrize("between", [0.33, 0.67])
@pytest.mark.run
def test_auto_checkpointing_fits_the_budget_with_fewer_layers(between):
    """Issue 15 acceptance 4: between the no-checkpointing and full-checkpointing peaks, the plan
    recomputes fewer layers than full checkpointing and the measured peak stays within budget."""
    from effpretrain.memory import plan_checkpointing

    probe = _llama_20m_auto(1.0)
    none = estimate_from_config(probe, 8192, checkpointed=[])
    full = estimate_from_config(probe, 8192, checkpointed=range(4))
    budget_gb = round((full.peak + between * (none.peak - full.peak)) / 1e9, 6)
    cfg = _llama_20m_auto(budget_gb)
    assert full.peak < budget_gb * 1e9 < none.peak
    layers, est = plan_checkpointing(cfg, 8192)
    assert 0 < len(layers) < 4 and est.peak <= budget_gb * 1e9
    assert estimate_from_config(cfg, 8192).detail["checkpointed_layers"] == layers
    assert _measured_run(cfg, 8192)["peak"] <= budget_gb * 1e9


def test_auto_checkpointing_refuses_a_budget_nothing_fits():
    from effpretrain.errors import ConfigError
    from effpretrain.memory import plan_checkpointing

    cfg = _llama_20m_auto(0.1)
    full = estimate_from_config(cfg, 8192, checkpointed=range(4)).peak
    assert full > 0.1e9
    with pytest.raises(
        ConfigError, match=rf"train.memory_budget_gb=0.1: nothing fits; .* peak is {full / 1e9:.3f} GB"
    ):
        plan_checkpointing(cfg, 8192)


def _tiny_auto(tiny_overrides, budget_gb):
    from effpretrain.config import load_config

    # The standard loss: at this tiny batch the chunked loss's peak is the optimizer step, which
    # checkpointing cannot lower, so no budget would lie between the two peaks.
    over = [*tiny_overrides, "train.max_steps=1", "train.eval_every=0", "train.activation_checkpointing=auto"]
    over.append("train.loss=standard")
    return load_config(
        ROOT / "recipes" / "tiny" / "adamw.yaml", [*over, f"train.memory_budget_gb={budget_gb}"]
    )


@pytest.mark.run
def test_auto_checkpointing_run_logs_its_choice(tmp_path, tiny_overrides, caplog):
    import logging

    from effpretrain.memory import plan_checkpointing
    from effpretrain.trainer import train

    probe = _tiny_auto(tiny_overrides, 1.0)
    none = estimate_from_config(probe, 512, checkpointed=[]).peak
    full = estimate_from_config(probe, 512, checkpointed=range(4)).peak
    cfg = _tiny_auto(tiny_overrides, round((none + full) / 2e9, 6))
    layers, est = plan_checkpointing(cfg, 512)
    assert 0 < len(layers) < 4
    with caplog.at_level(logging.INFO, logger="effpretrain"):
        train(cfg, tmp_path / "run")
    assert f"activation_checkpointing=auto: layers {layers} within" in caplog.text
    assert f"(estimated peak {est.peak / 1e9:.3f} GB)" in caplog.text


@pytest.mark.run
def test_auto_checkpointing_budget_nothing_fits_exits_2(tmp_path, tiny_overrides):
    import subprocess
    import sys

    sets = [*tiny_overrides, "train.activation_checkpointing=auto", "train.memory_budget_gb=0.001"]
    env = child_env(threads=None)
    args = [sys.executable, "-m", "effpretrain", "train", str(ROOT / "recipes" / "tiny" / "adamw.yaml")]
    args += [f"--set={s}" for s in sets] + ["--out", str(tmp_path / "run")]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "train.memory_budget_gb=0.001: nothing fits" in lines[0]


def test_adam_mini_query_and_key_get_one_block_per_head():
    """The registry's `head_blocks` fact: the trainer puts every q and k weight in a group with the
    head size as ``block_rows`` (one second moment per head), and the estimator counts the same
    state (the tiny recipe's measured state equals the estimate: the recipe tests above)."""
    from effpretrain.config import load_config
    from effpretrain.models import PRESETS
    from effpretrain.optim_setup import build_param_groups

    cfg = load_config(ROOT / "recipes" / "tiny" / "adam_mini.yaml")
    model = build_model("tiny", cfg.data.vocab_size)
    groups = build_param_groups(model, cfg)
    heads = [g for g in groups if g.get("block_rows")]
    p = PRESETS["tiny"]
    assert len(heads) == 1 and heads[0]["block_rows"] == p.hidden // p.heads
    names = {id(w): n for n, w in model.named_parameters()}
    assert sorted(names[id(w)].rsplit(".", 2)[-2] for w in heads[0]["params"]) == sorted(
        ["q_proj", "k_proj"] * p.layers
    )
    spec = optimizers.method_spec("adam_mini")
    want = sum(spec.state_bytes(tuple(w.shape), g, torch.float32) for g in groups for w in g["params"])
    est = estimate("tiny", "adam_mini", dtype="fp32", vocab_size=cfg.data.vocab_size)
    assert est.optimizer_state == want
    galore = optimizers.method_spec("galore")
    assert galore.head_block_group(64) == {} and spec.head_block_group(64) == {"block_rows": 64}


# ----------------------------------------------------------------------------------------------
# train.update_in_backward (issue 17): accumulators + gradients in flight.


def _inb(method: str, k: int, **kw):
    from effpretrain.config import OptimConfig

    args = dict(dtype="fp32", optim_cfg=OptimConfig(name=method, rank=32), batch_size=2, seq_len=64)
    args.update(kw)
    return (
        estimate("tiny", method, grad_accum=k, **args),
        estimate("tiny", method, grad_accum=k, update_in_backward=True, **args),
    )


@pytest.mark.parametrize("method", ["adamw", "galore", "fira", "apollo", "adam_mini"])
@pytest.mark.parametrize("k", [1, 4])
def test_in_backward_changes_only_the_gradient_terms(method, k):
    """Weights, state and activations are the normal path's; so is every normal-path figure (the
    flag's default is off), and ``grads_all_parameters`` is the normal path's gradient figure."""
    normal, inb = _inb(method, k)
    assert estimate("tiny", method, dtype="fp32", grad_accum=k, batch_size=2, seq_len=64).as_dict() == (
        estimate(
            "tiny", method, dtype="fp32", grad_accum=k, batch_size=2, seq_len=64, update_in_backward=False
        ).as_dict()
    )
    assert "update_in_backward" not in normal.detail
    for key in ("weights", "optimizer_state", "activations", "params", "trainable_params"):
        assert getattr(inb, key) == getattr(normal, key)
    assert inb.detail["update_in_backward"] is True
    assert inb.detail["grads_all_parameters"] == normal.grads


def test_in_backward_gradient_rule_by_hand():
    """tiny (V 8192, h 128, untied embedding and head, the largest tensors: 4 V h bytes each).
    K = 1: only the largest step unit's gradient, 4 V h. K = 4: every accumulator (all full for
    AdamW) plus the largest gradient being produced."""
    V, h = 8192, 128
    largest = 4 * V * h
    normal, inb = _inb("adamw", 1)
    assert inb.grads == inb.detail["grads_in_flight"] == largest
    assert inb.detail["grad_accumulators"] == 0
    normal, inb = _inb("adamw", 4)
    assert inb.detail["grad_accumulators"] == inb.detail["grad_accumulators_at_refresh"] == normal.grads
    assert inb.grads == normal.grads + largest


def test_in_backward_galore_accumulates_low_rank_between_refreshes():
    """GaLore (PROJECTED_GRAD_ONLY, SVD basis): each projected m x n matrix accumulates
    r x max(m, n) between refreshes; everything else full. At a refresh every projected matrix
    keeps a full accumulator: the normal path's gradient bytes (the spike, its own moments)."""
    from effpretrain.config import ATTN_MLP_TARGETS

    r = 32
    normal, inb = _inb("galore", 4)
    want = sum(
        4 * (r * max(s.shape) if s.linear in ATTN_MLP_TARGETS else math.prod(s.shape))
        for s in model_param_shapes("tiny", None)
    )
    assert inb.detail["grad_accumulators"] == want < normal.grads
    assert inb.detail["grad_accumulators_at_refresh"] == normal.grads
    assert inb.detail["grads_at_refresh"] == normal.grads + inb.detail["grads_in_flight"]
    # The refresh step's larger accumulators are part of the peak (its own moments)...
    assert inb.detail["peak_moment"].startswith("refresh_")
    assert inb.peak - inb.detail["peak_between_refreshes"] == normal.grads - want
    # ...and K = 1 has no accumulators, so no spike.
    _, one = _inb("galore", 1)
    assert one.peak == one.detail["peak_between_refreshes"] and one.detail["grads_at_refresh"] == one.grads


@pytest.mark.parametrize("method", ["fira", "apollo", "golore"])
def test_in_backward_full_accumulators_where_the_class_reads_g(method):
    """Fira and APOLLO read G itself (PROJECTED_GRAD_ONLY false), GoLore's basis is not a stored
    SVD basis: full accumulators, read from the registry's class (no method-name rule)."""
    normal, inb = _inb(method, 4)
    cls = optimizers.method_spec(method).cls
    assert cls.PROJECTED_GRAD_ONLY == (method == "golore")
    assert inb.detail["grad_accumulators"] == normal.grads


def test_in_backward_moments_hold_no_full_gradient_set():
    """K = 1: no moment holds every gradient; the step's transient is inside backward (the block
    moment carries the largest unit's), and the step after backward holds no gradient."""
    from effpretrain import memory

    normal, inb = _inb("adamw", 1, batch_size=1, seq_len=16)
    assert normal.detail["peak_moment"] == "optimizer_step"
    assert inb.detail["peak_moment"] != "optimizer_step"
    assert inb.detail["peak_terms"].get("grads", 0) <= inb.grads < normal.grads
    assert inb.peak < normal.peak
    assert inb.detail["in_backward_step_transient"] > 0
    table = memory.format_table(inb)
    assert "updates in backward" in table and "accumulators" in table
    assert "updates in backward" not in memory.format_table(normal)
    # Each unit steps alone: the largest tensor's transient, not the foreach sum over all tensors.
    spec = optimizers.method_spec("adamw")
    assert inb.detail["in_backward_step_transient"] == spec.step_transient_bytes(
        (8192, 128), {}, torch.float32
    )
    assert inb.detail["in_backward_step_transient"] < normal.detail["peak_terms"]["optimizer_transient"]


def test_in_backward_fsdp2_accumulators_are_shards():
    """Under FSDP2 (every micro-step reduce-scattered, assumed) each rank keeps full accumulators of
    its shards: rank 0's gradient bytes; GaLore's low-rank accumulation does not apply to DTensors."""
    for method in ("adamw", "galore"):
        normal, inb = _inb(method, 4, world_size=2, sharding="fsdp2")
        assert inb.detail["grad_accumulators"] == normal.grads
        _, one = _inb(method, 4)
        assert normal.grads < one.detail["grads_all_parameters"]


def test_estimate_command_shows_the_in_backward_mode(capsys):
    """``effpretrain estimate --update-in-backward`` (a minimal flag in effpretrain/cli.py): the
    table names the mode and its gradient terms; the figures are the estimator's."""
    from effpretrain import cli
    from effpretrain.config import OptimConfig

    args = ["estimate", "--model", "llama_60m", "--method", "galore", "--rank", "128", "--grad-accum", "4"]
    assert cli.main([*args, "--update-in-backward", "--grad-clip", "0"]) == 0
    out = capsys.readouterr().out
    assert "updates in backward" in out and "accumulators" in out and "at a refresh step" in out

    def galore_60m(grad_clip: float):
        cfg = OptimConfig(name="galore", rank=128)
        return estimate(
            "llama_60m", "galore", optim_cfg=cfg, grad_accum=4, update_in_backward=True, grad_clip=grad_clip
        )

    want = galore_60m(0.0)
    assert f"({want.grads:,} B)" in out
    # train.grad_clip's default (1.0): clipping on, so every accumulator is full (more bytes).
    assert cli.main([*args, "--update-in-backward"]) == 0
    clipped = galore_60m(1.0)
    assert clipped.grads > want.grads and f"({clipped.grads:,} B)" in capsys.readouterr().out
    assert cli.main(args) == 0
    assert "updates in backward" not in capsys.readouterr().out


def test_fsdp2_peak_per_rank():
    """Under FSDP2 a whole-stepped matrix's state and step temporaries live on its owner rank, so
    the ranks' peaks differ (Qwen2.5-0.5B, 8-bit GaLore in backward on 8 ranks: the owner of the
    896-wide tied embedding, whose rows are not whole 256-entry blocks, steps it whole); the
    estimate's peak is the largest of them, and the table prints every rank's."""
    from effpretrain.memory import format_table

    kw = dict(dtype="bf16-pure", batch_size=1, seq_len=2048, activation_checkpointing=1, world_size=8)
    est = estimate(
        "qwen2.5_0.5b", "galore_8bit", sharding="fsdp2", update_in_backward=True, grad_clip=0.0, **kw
    )
    ranks = est.detail["peak_per_rank"]
    assert len(ranks) == 8 and max(ranks) == est.peak and min(ranks) < 0.95 * max(ranks)
    assert all(f"rank {r}" in format_table(est) for r in range(8))
    # A run whose ranks hold the same (element-wise state, sharded): one figure for all.
    even = estimate("llama3_8b", "adamw", sharding="fsdp2", **kw)
    assert even.detail["peak_per_rank"] == [even.peak] * 8 and "rank 0" not in format_table(even)


def test_7b_on_one_24gb_gpu_and_8b_under_8gb_per_rank():
    """The budgets the large presets are built for, as the estimator states them: a LLaMA-7B step
    with 8-bit GaLore and per-layer updates at token batch 256 (GaLore's headline) fits 24 GB, also
    accumulating 4 micro-batches at rank 512 with the refresh on the first one's gradient; BF16
    AdamW needs more than twice that; Llama-3-8B on 8 FSDP2 ranks (activation checkpointing, 2048
    tokens, the chunked or the standard loss) fits 8 GB on every rank, the 128k x 4096 embedding and head stepped by
    rows on every rank (whole 256-entry blocks), not whole on two owners."""
    from effpretrain.config import OptimConfig

    seven = dict(dtype="bf16-pure", batch_size=1, seq_len=256)
    inb = dict(update_in_backward=True, grad_clip=0.0)
    galore = estimate(
        "llama_7b", "galore_8bit", optim_cfg=OptimConfig(name="galore_8bit", rank=1024), **inb, **seven
    )
    assert galore.peak <= 24e9
    assert estimate("llama_7b", "adamw", **seven).peak >= 2 * 24e9
    accum = estimate(
        "llama_7b",
        "galore_8bit",
        optim_cfg=OptimConfig(name="galore_8bit", rank=512),
        grad_accum=4,
        in_backward_refresh="first_micro",
        **inb,
        **seven,
    )
    assert accum.peak <= 24e9
    kw = dict(dtype="bf16-pure", batch_size=1, seq_len=2048, activation_checkpointing=1, world_size=8)
    for loss in ("chunked", "standard"):
        eight = estimate("llama3_8b", "galore_8bit", sharding="fsdp2", loss=loss, **inb, **kw)
        ranks = eight.detail["peak_per_rank"]
        assert len(ranks) == 8 and max(ranks) <= 8e9, loss
        assert min(ranks) > 0.999 * max(ranks)  # no owner rank carries the embedding's or head's step


def _options(group: dict | None) -> tuple:
    """A param group's options as the estimator's formulas read them: without its parameters, the
    weight decay and LORO's pair mark (no state or step formula depends on those)."""
    skip = ("params", "weight_decay", optimizers.FACTOR_PAIRS_KEY)
    return tuple(sorted((k, repr(v)) for k, v in (group or {}).items() if k not in skip))


@pytest.mark.parametrize("recipe", [p.stem for p in RECIPES])
def test_the_trainer_and_the_estimator_build_the_same_groups_from_one_lookup(recipe, monkeypatch):
    """One `OptimPlan` per build: building a run's optimizer looks its method's registry row up
    once (counted), and the estimator tallies every trainable tensor with the options of the group
    the trainer puts it in (multisets of (shape, options) over every tiny recipe; a warm start is
    left off, as its two phases train different tensors by design)."""
    from collections import Counter

    from effpretrain.config import load_config
    from effpretrain.memory import estimate_from_config, terms
    from effpretrain.models.llama import model_shape
    from effpretrain.optim_setup import build_optimizer_and_schedule, build_param_groups
    from effpretrain.run_model import build_run_model

    cfg = load_config(ROOT / "recipes" / "tiny" / f"{recipe}.yaml", ["factor.warm_start_steps=0"])
    vocab = model_shape(cfg.model).vocab
    model, _ = build_run_model(cfg, vocab)
    looked_up: list[str] = []
    real = optimizers.method_spec
    monkeypatch.setattr(optimizers, "method_spec", lambda name: looked_up.append(name) or real(name))
    build_optimizer_and_schedule(model, cfg)
    assert looked_up == [cfg.optim.name]

    trainer = Counter(
        (tuple(p.shape), _options(g)) for g in build_param_groups(model, cfg) for p in g["params"]
    )
    tallied: Counter = Counter()
    tally = terms._Tally.trainable_tensor

    def spy(self, shape, group=None):
        tallied[(tuple(shape), _options(group))] += 1
        return tally(self, shape, group)

    monkeypatch.setattr(terms._Tally, "trainable_tensor", spy)
    estimate_from_config(cfg, vocab, checkpointed=[])
    assert tallied == trainer
