"""Claims about CoLA and CoLA-M (`factor.kind: cola`, `cola_m`; effpretrain/models/factorized.py):
the formula, identity-CoLA == Low-Rank, CoLA-M == CoLA with fewer saved bytes, the registry facts
(no dense weight, no refactorization), the estimator, exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _common import ROOT, assert_resumed_from
from safetensors.torch import load_file

from effpretrain import cli
from effpretrain.config import load_config
from effpretrain.errors import ConfigError
from effpretrain.memory import estimate
from effpretrain.models import FACTOR_KINDS, CoLALinear, CoLAMLinear, LowRankLinear, apply_factorization
from effpretrain.models.factorized import factorized_param_counts, merge_factorized_


def _pair(m=12, n=20, r=4, alpha=8.0, bias=False, seed=0):
    torch.manual_seed(seed)
    cola = CoLALinear(n, m, r, alpha, bias=bias)
    colam = CoLAMLinear(n, m, r, alpha, bias=bias)
    colam.load_state_dict(cola.state_dict())
    return cola, colam


@pytest.mark.parametrize("bias", [False, True])
def test_forward_equals_the_formula(bias):
    """y = B silu(s A x) + b, written out in fp64."""
    layer, _ = _pair(bias=bias)
    x = torch.randn(3, 7, 20)
    z = layer.scale * (x.double() @ layer.A.double().t())
    ref = (z * torch.sigmoid(z)) @ layer.B.double().t()
    if bias:
        ref = ref + layer.bias.double()
    assert torch.allclose(layer(x).double(), ref, atol=1e-6)
    # The nonlinearity matters: the same factors as Low-Rank give another function.
    low = LowRankLinear(20, 12, 4, 8.0, bias=layer.bias)
    low.load_state_dict(layer.state_dict())
    assert not torch.allclose(low(x), layer(x), atol=1e-3)


def test_init_is_the_authors_gaussian():
    """A, B ~ N(0, (r (m + n))^(-1/2)), so Var((B A)_ij) = 1 / (m + n)."""
    torch.manual_seed(0)
    m, n, r = 256, 384, 64
    layer = CoLALinear(n, m, r, float(r))
    std = (r * (m + n)) ** -0.25
    for p in (layer.A, layer.B):
        assert p.mean().abs() < 0.05 * std
        assert p.std().item() == pytest.approx(std, rel=0.02)
    assert (layer.B @ layer.A).var().item() == pytest.approx(1 / (m + n), rel=0.05)


def _model(kind, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    report = apply_factorization(model, kind, rank=8, alpha=16.0)
    assert len(report["replaced"]) == 14
    return model


@pytest.mark.parametrize("kind", ["cola", "cola_m"])
def test_identity_cola_equals_low_rank_step_for_step(kind):
    """Acceptance: with sigma the identity, CoLA (and CoLA-M) is Low-Rank: the same init (copied) and
    the same AdamW steps give bitwise-equal losses and weights. Bitwise because the same kernels
    run: CoLA's forward is Low-Rank's F.linear calls with an identity between them, and CoLA-M's
    backward issues the aten calls autograd issues for them (see the next test)."""
    low, cola = _model("lowrank"), _model(kind)
    cola.load_state_dict(low.state_dict())
    for layer in cola.modules():
        if isinstance(layer, CoLALinear):
            layer.activation = "identity"
    opts = [torch.optim.AdamW(mod.parameters(), lr=1e-2) for mod in (low, cola)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 128, (2, 12), generator=g)
        losses = []
        for mod, opt in zip((low, cola), opts):
            opt.zero_grad()
            loss = mod(ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    a, b = low.state_dict(), cola.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and with SiLU (the default) the two differ
    for layer in cola.modules():
        if isinstance(layer, CoLALinear):
            layer.activation = "silu"
    ids = torch.randint(0, 128, (2, 12), generator=g)
    assert low(ids, labels=ids).loss.item() != cola(ids, labels=ids).loss.item()


@pytest.mark.parametrize("bias", [False, True])
def test_cola_m_outputs_and_gradients_equal_cola(bias):
    """Bitwise: CoLA-M's backward issues the aten calls autograd issues for CoLA's graph, with the
    same operands and layouts (logged with a TorchDispatchMode: dB = mm(G^T, h) and dA =
    mm(dz^T, x) as autograd computes the gradient of a transposed weight, dh = mm(G, B),
    silu_backward, dx = mm(dz, A), the bias's row sum), so no kernel sums in another order."""
    cola, colam = _pair(bias=bias)
    x = torch.randn(3, 7, 20, requires_grad=True)
    grads = []
    for layer in (cola, colam):
        x.grad = None
        y = layer(x)
        y.square().sum().backward()
        grads.append([y.detach(), x.grad.clone(), *(p.grad for p in layer.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_cola_m_under_autocast_gives_parameter_dtype_gradients():
    cola, colam = _pair()
    x = torch.randn(4, 20)
    outs = []
    for layer in (cola, colam):
        with torch.autocast("cpu", torch.bfloat16):
            y = layer(x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        assert layer.A.grad.dtype == layer.B.grad.dtype == torch.float32
        outs.append([y.float(), layer.A.grad, layer.B.grad])
    assert all(torch.allclose(a, b, rtol=2e-2, atol=2e-2) for a, b in zip(*outs))


def _saved_bytes(layer, x):
    own = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(seen.values())


def test_saved_bytes_two_rank_tensors_for_cola_one_for_cola_m():
    """Per layer, besides x: CoLA saves sigma's input and output (2 N r e), CoLA-M only the input."""
    m, n, r, N = 48, 40, 8, 30
    cola, colam = _pair(m=m, n=n, r=r)
    x = torch.randn(N, n, requires_grad=True)
    x_bytes = N * n * 4
    assert (
        _saved_bytes(cola, x)
        == x_bytes + FACTOR_KINDS["cola"].rank_saves * N * r * 4
        == x_bytes + 2 * N * r * 4
    )
    assert (
        _saved_bytes(colam, x)
        == x_bytes + FACTOR_KINDS["cola_m"].rank_saves * N * r * 4
        == x_bytes + N * r * 4
    )


def test_estimate_cola_m_saves_less_than_cola_same_weights_and_state():
    kw = dict(factor_rank=512, batch_size=32, seq_len=256, dtype="bf16-pure")
    cola = estimate("llama_1b", "adamw", factor_kind="cola", **kw)
    colam = estimate("llama_1b", "adamw", factor_kind="cola_m", **kw)
    low = estimate("llama_1b", "adamw", factor_kind="lowrank", **kw)
    assert cola.weights == colam.weights == low.weights
    assert cola.optimizer_state == colam.optimizer_state == low.optimizer_state
    # 7 targets per block, 24 blocks: CoLA-M keeps one N x r tensor per layer less (bf16: 2 bytes).
    N = 32 * 256
    assert cola.activations - colam.activations == 24 * 7 * N * 512 * 2
    assert colam.activations == low.activations


@pytest.mark.parametrize("kind", ["cola", "cola_m"])
def test_registry_facts_and_param_counts(kind):
    spec = FACTOR_KINDS[kind]
    assert not spec.refactorizable and not spec.dense_equivalent and not spec.merges_at_restart
    assert not spec.frozen_dense and not spec.sparse and spec.restart_transient_bytes(64, 48, 8) == 0
    assert spec.flops_per_token(64, 48, 8) == FACTOR_KINDS["lowrank"].flops_per_token(64, 48, 8)
    layer = spec.layer(48, 64, 8, 8.0, bias=True)
    held = sum(p.numel() for p in layer.parameters())
    assert factorized_param_counts(64, 48, kind, 8, bias=True) == {
        "trainable": held,
        "frozen": 0,
        "index_elements": 0,
    }
    assert held == 8 * (64 + 48) + 64
    with pytest.raises(ValueError, match="refactorizing needs B A"):
        type(spec)("bad", CoLALinear, dense_equivalent=False)


def test_no_dense_weight_and_merge_refuses_leaving_the_model_unchanged():
    layer, _ = _pair()
    with pytest.raises(TypeError, match="no dense weight"):
        layer.dense_weight()
    model = _model("cola")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"model\.layers\.0\.self_attn\.q_proj \(CoLALinear\) has no dense"):
        merge_factorized_(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kind", ["cola", "cola_m"])
def test_refactorizing_restarts_are_refused_with_one_line(kind, capsys, tmp_path):
    recipe = str(ROOT / "recipes" / "tiny" / f"{kind}.yaml")
    ask = ["restarts.every=10", "restarts.refactorize=true"]
    with pytest.raises(ConfigError, match=f"factor.kind={kind} cannot be refactorized"):
        load_config(recipe, ask)
    # momentum reset alone is fine (the tiny recipe's restarts.refactorize: false)
    assert load_config(recipe, ["restarts.every=10"]).restarts.refactorize is False
    assert cli.main(["train", recipe, "--set", ask[0], "--set", ask[1], "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "restarts.refactorize=false" in err
    # The HF Trainer factory gives the same reason, and builds the momentum-reset-only restarts.
    from effpretrain import hf
    from optimizers import Restarts

    with pytest.raises(ConfigError, match=f"factor.kind={kind} cannot be refactorized"):
        hf.create_optimizer(_model(kind), "adamw", num_training_steps=20, lr=1e-3, restarts_every=10)
    opt, _ = hf.create_optimizer(
        _model(kind), "adamw", num_training_steps=20, lr=1e-3, restarts_every=10, refactorize=False
    )
    assert isinstance(opt, Restarts) and not opt.refactorize and opt.reset_momentum


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    last = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    return load_file(str(last / "model.safetensors"))


@pytest.mark.parametrize("kind", ["cola", "cola_m"])
def test_split_run_equals_straight_run(kind, tmp_path, tiny_overrides):
    """Exact resume: 6 steps straight vs 3 + resume to 6 (which starts at step 4 with the straight
    run's loss there), bitwise-equal weights and val loss: the same operations in the same order
    once the state is restored."""
    from effpretrain.trainer import train

    over = tiny_overrides + [
        "train.max_steps=6",
        "train.save_every=3",
        "train.eval_every=3",
        "train.log_every=1",
    ]
    recipe = ROOT / "recipes" / "tiny" / f"{kind}.yaml"
    straight = train(load_config(recipe, over), tmp_path / "straight")
    resumed = train(
        load_config(recipe, over),
        tmp_path / "resumed",
        resume=str(tmp_path / "straight" / "checkpoints" / "step-3"),
    )
    a, b = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and any(k.endswith("q_proj.A") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert_resumed_from(tmp_path / "straight", tmp_path / "resumed", 3)
    assert resumed["final_val_loss"] == straight["final_val_loss"] and math.isfinite(
        straight["final_val_loss"]
    )
    # the state bytes summary.json reports are the estimator's
    assert straight["optimizer_state_bytes"] == straight["estimated"]["optimizer_state"]
