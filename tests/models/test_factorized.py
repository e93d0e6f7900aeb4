"""Claims about effpretrain/models/factorized.py: formulas, inits, counts, surgery, merges."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from effpretrain.models.factorized import (
    FactorizedLinear,
    LoRALinear,
    LowRankLinear,
    ReLoRALinear,
    SLTrainLinear,
    apply_factorization,
    factor_pairs,
    factorized_param_counts,
    merge_factorized_,
    relora_merge_,
)
from optimizers.refactorization import refactorize_

KINDS = ["lowrank", "lora", "relora", "sltrain"]


def _layer(
    kind: str, m: int = 12, n: int = 20, r: int = 4, alpha: float = 8.0, bias: bool = False, seed: int = 0
):
    torch.manual_seed(seed)
    b = nn.Parameter(torch.randn(m)) if bias else None
    if kind == "lowrank":
        return LowRankLinear(n, m, r, alpha, bias=b)
    if kind == "lora":
        return LoRALinear(n, m, r, alpha, bias=b)
    if kind == "relora":
        return ReLoRALinear(n, m, r, alpha, bias=b)
    return SLTrainLinear(n, m, r, alpha, density=0.1, seed=seed, bias=b)


def _train(module: nn.Module, steps: int = 3, seed: int = 0, shape: tuple[int, int] | None = None):
    """A few AdamW steps on a regression target, so zero-initialised factors become nonzero."""
    n_in, n_out = shape or (module.in_features, module.out_features)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, n_in, generator=g)
        y = torch.randn(5, n_out, generator=g)
        opt.zero_grad()
        F.mse_loss(module(x), y).backward()
        opt.step()
    return opt


def _reference_weight(layer: FactorizedLinear) -> torch.Tensor:
    """Each layer's effective weight written out independently of its own code, in fp64."""
    low = layer.scale * (layer.B.double() @ layer.A.double())
    if isinstance(layer, LoRALinear):
        return layer.weight.double() + low
    if isinstance(layer, SLTrainLinear):
        S = torch.zeros(layer.out_features * layer.in_features, dtype=torch.float64)
        S[layer.sparse_index] = layer.sparse_values.double()
        return low + S.view(layer.out_features, layer.in_features)
    return low


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_dense_weight_equal_the_formula(kind, bias):
    layer = _layer(kind, bias=bias)
    _train(layer)
    assert torch.count_nonzero(layer.B) > 0
    W = _reference_weight(layer)
    x = torch.randn(7, layer.in_features)
    expected = x.double() @ W.T + (layer.bias.double() if bias else 0.0)
    assert torch.allclose(layer(x).double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.allclose(layer.dense_weight().double(), W, atol=1e-6)
    assert layer.dense_weight().shape == (layer.out_features, layer.in_features)


def test_inits():
    lr = _layer("lowrank", m=64, n=100, r=16)
    assert torch.count_nonzero(lr.B) == lr.B.numel() and torch.count_nonzero(lr.A) == lr.A.numel()
    assert lr.A.abs().max() <= 1 / math.sqrt(100) and lr.A.abs().max() > 0.8 / math.sqrt(100)
    assert lr.B.abs().max() <= 1 / math.sqrt(16) and lr.B.abs().max() > 0.8 / math.sqrt(16)
    for kind in ("lora", "relora", "sltrain"):
        layer = _layer(kind, m=64, n=100, r=16)
        assert torch.count_nonzero(layer.B) == 0  # B zero ...
        assert torch.count_nonzero(layer.A) == layer.A.numel()  # ... A never zero: B gets gradient
        assert layer.A.abs().max() <= 1 / math.sqrt(100)
    lora = _layer("lora")
    assert not lora.weight.requires_grad and lora.A.requires_grad and lora.B.requires_grad
    sl = _layer("sltrain", m=64, n=100)
    assert sl.sparse_values.abs().max() <= 1 / math.sqrt(100) and sl.sparse_values.abs().max() > 0.08


def test_bias_options():
    assert LowRankLinear(6, 4, 2, 1.0).bias is None and LowRankLinear(6, 4, 2, 1.0, bias=False).bias is None
    fresh = SLTrainLinear(9, 4, 2, 1.0, bias=True).bias
    assert fresh.shape == (4,) and fresh.requires_grad and 0 < fresh.abs().max() <= 1 / 3
    kept = nn.Parameter(torch.ones(4))
    assert LoRALinear(6, 4, 2, 1.0, bias=kept).bias is kept


def test_zero_b_still_learns():
    for kind in ("lora", "sltrain"):
        layer = _layer(kind)
        F.mse_loss(layer(torch.randn(3, layer.in_features)), torch.randn(3, layer.out_features)).backward()
        assert torch.count_nonzero(layer.B.grad) > 0


def test_sltrain_support():
    m, n, delta = 30, 50, 0.07
    layer = SLTrainLinear(n, m, 4, 8.0, density=delta, seed=3)
    idx = layer.sparse_index
    assert idx.dtype == torch.int64 and idx.numel() == math.floor(delta * m * n) == 105
    assert idx.unique().numel() == idx.numel() and idx.min() >= 0 and idx.max() < m * n
    assert torch.equal(SLTrainLinear(n, m, 4, 8.0, density=delta, seed=3).sparse_index, idx)
    assert not torch.equal(SLTrainLinear(n, m, 4, 8.0, density=delta, seed=4).sparse_index, idx)
    assert SLTrainLinear(10, 10, 2, 1.0, density=0.29).sparse_index.numel() == 29  # no float floor error


def test_sltrain_support_survives_state_dict_round_trip():
    layer = _layer("sltrain", seed=1)
    _train(layer)
    assert "sparse_index" in layer.state_dict()
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    other = _layer("sltrain", seed=2)
    assert not torch.equal(other.sparse_index, layer.sparse_index)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(other.sparse_index, layer.sparse_index)
    x = torch.randn(4, layer.in_features)
    assert torch.equal(other(x), layer(x))  # bitwise: the same tensors through the same forward


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,n,r,bias", [(12, 20, 4, False), (33, 17, 5, True), (64, 64, 64, False)])
def test_param_counts_match_the_layers(kind, m, n, r, bias):
    layer = _layer(kind, m=m, n=n, r=r, bias=bias)
    density = layer.density if isinstance(layer, SLTrainLinear) else 0.03
    counts = factorized_param_counts(m, n, kind, r, density=density, bias=bias)
    held = {
        "trainable": sum(p.numel() for p in layer.parameters() if p.requires_grad),
        "frozen": sum(p.numel() for p in layer.parameters() if not p.requires_grad),
        "index_elements": sum(b.numel() for b in layer.buffers()),
    }
    assert counts == held


def test_param_counts_formula_and_errors():
    assert factorized_param_counts(2048, 5461, "lowrank", 512) == {
        "trainable": 512 * (2048 + 5461),
        "frozen": 0,
        "index_elements": 0,
    }
    assert factorized_param_counts(100, 100, "sltrain", 8, density=0.03)["index_elements"] == 300
    with pytest.raises(ValueError, match="unknown factorization kind 'dense'"):
        factorized_param_counts(4, 4, "dense", 2)


def test_relora_merge_preserves_outputs_and_loses_no_update():
    layer = _layer("relora", m=16, n=24, r=4)
    opt = _train(layer, steps=4)
    x = torch.randn(9, 24)
    before = layer(x).detach()
    W0, B, A = layer.weight.clone(), layer.B.detach().clone(), layer.A.detach().clone()
    assert torch.count_nonzero(B) > 0

    layer.merge_and_reinit_()

    assert torch.allclose(layer(x), before, atol=1e-6)
    assert torch.allclose(layer.weight, W0 + layer.scale * B @ A, atol=1e-7)  # the update is in W0
    assert not torch.allclose(layer.weight, W0)
    assert torch.count_nonzero(layer.B) == 0 and torch.count_nonzero(layer.A) == layer.A.numel()
    assert not torch.equal(layer.A, A)  # fresh A
    # training continues from the merged point
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(layer(x), torch.zeros_like(before)).backward()
        opt.step()
    assert torch.count_nonzero(layer.B) > 0


class _OnDevice(torch.Tensor):
    """A CPU tensor that reports a CUDA device: the device branch of `init_on_cpu_` without a GPU."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


@pytest.mark.parametrize(
    "init",
    [
        lambda x: nn.init.kaiming_uniform_(x, a=math.sqrt(5)),
        lambda x: nn.init.uniform_(x, -0.1, 0.1),
        lambda x: nn.init.normal_(x, std=0.3),
    ],
)
def test_factor_inits_on_a_device_draw_on_the_cpu_from_the_global_generator(init):
    """docs/gpu.md, G7: a device tensor is filled from a CPU draw of torch's global CPU generator (the
    one the trainer checkpoints), so its values do not depend on the device; the init never runs on
    the device tensor itself."""
    from effpretrain.models.factorized.layers import init_on_cpu_

    seen = []
    t = torch.Tensor._make_subclass(_OnDevice, torch.zeros(6, 10))
    assert t.device.type == "cuda"
    torch.manual_seed(3)
    init_on_cpu_(t, lambda x: seen.append(x.device.type) or init(x))
    after = torch.get_rng_state()
    torch.manual_seed(3)
    expected = torch.empty(6, 10)
    init(expected)
    assert seen == ["cpu"]
    assert torch.equal(t.as_subclass(torch.Tensor), expected)
    assert torch.equal(after, torch.get_rng_state())  # the same draws consumed from the global CPU stream
    # A meta tensor has nothing to fill and consumes no draw (a model built on meta stays free).
    torch.manual_seed(3)
    init_on_cpu_(torch.empty(6, 10, device="meta"), init)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(3).get_state())


def test_relora_reinit_draws_a_from_the_global_cpu_generator():
    layer = _layer("relora", m=16, n=24, r=4)
    torch.manual_seed(11)
    layer.merge_and_reinit_()
    torch.manual_seed(11)
    expected = torch.empty(4, 24)
    nn.init.kaiming_uniform_(expected, a=math.sqrt(5))
    assert torch.equal(layer.A.detach(), expected)


@pytest.mark.parametrize("prune_ratio", [None, 0.5])
def test_relora_merge_on_a_model_fixes_the_factor_state(prune_ratio):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
    for name, lin in list(model.named_children()):
        if isinstance(lin, nn.Linear):
            model._modules[name] = ReLoRALinear(lin.in_features, lin.out_features, 4, 4.0, weight=lin.weight)
    model.add_module("head", nn.Linear(8, 8))
    opt = _train(model, steps=3, shape=(16, 8))
    head_state = {k: v.clone() for k, v in opt.state[model.head.weight].items()}
    x = torch.randn(5, 16)
    before = model(x).detach()

    assert relora_merge_(model, opt, prune_ratio=prune_ratio) == 2

    assert torch.allclose(model(x), before, atol=1e-6)
    for layer in (model[0], model[2]):
        for p in layer.factor_pair():
            st = opt.state[p]
            if prune_ratio is None:
                assert st["step"].item() == 0 and torch.count_nonzero(st["exp_avg"]) == 0
            else:
                assert st["step"].item() == 3
                assert torch.count_nonzero(st["exp_avg"]) == p.numel() - math.floor(0.5 * p.numel())
    for k, v in head_state.items():
        assert torch.equal(opt.state[model.head.weight][k], v)


# ----- model surgery on a tiny LLaMA ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=128,
        max_position_embeddings=64,
    )


def _llama(config, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _step(model, ids: torch.Tensor) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(ids, labels=ids).loss.backward()
    opt.step()


@pytest.mark.parametrize("kind", KINDS)
def test_apply_factorization_replaces_the_targets(llama_config, kind, caplog):
    model = _llama(llama_config)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    q_weight = model.model.layers[0].self_attn.q_proj.weight
    with caplog.at_level(logging.INFO, logger="effpretrain"):
        report = apply_factorization(model, kind, rank=8, alpha=16.0, density=0.05)
    assert len(report["replaced"]) == 14
    assert "model.layers.0.self_attn.q_proj" in report["replaced"]
    assert "replaced 14 Linear layers" in caplog.text and kind in caplog.text
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, FactorizedLinear) and type(model.lm_head) is nn.Linear
    assert model.model.embed_tokens.weight is embed and model.lm_head.weight is head
    if kind in ("lora", "relora"):
        assert q.weight is q_weight and not q.weight.requires_grad  # W0 is the original, frozen
    # counts: the rest of the model plus factorized_param_counts of each target
    rest = embed.numel() + head.numel() + sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    shapes = [(64, 64)] * 4 + [(128, 64), (128, 64), (64, 128)]
    per_layer = [factorized_param_counts(m, n, kind, 8, density=0.05) for m, n in shapes]
    trainable = rest + 2 * sum(c["trainable"] for c in per_layer)
    frozen = 2 * sum(c["frozen"] for c in per_layer)
    assert report["trainable_params"] == trainable
    assert report["params_after"] == trainable + frozen
    assert report["index_elements"] == 2 * sum(c["index_elements"] for c in per_layer)
    assert report["params_before"] == rest + 2 * sum(m * n for m, n in shapes)
    assert len(factor_pairs(model)) == 14
    ids = torch.randint(0, 128, (2, 12))
    assert torch.isfinite(model(ids, labels=ids).loss)


def test_apply_factorization_errors_leave_the_model_unchanged(llama_config):
    model = _llama(llama_config)
    names = [n for n, _ in model.named_modules()]
    with pytest.raises(ValueError, match=r"kind='lowrank'.*replaced nothing.*\['nope'\]"):
        apply_factorization(model, "lowrank", 8, 16.0, targets=("nope",))
    with pytest.raises(
        ValueError, match=r"rank 65 exceeds min\(m, n\)=64 of model\.layers\.0\.self_attn\.q_proj"
    ):
        apply_factorization(model, "lowrank", 65, 16.0)
    with pytest.raises(ValueError, match="unknown factorization kind 'svd'"):
        apply_factorization(model, "svd", 8, 16.0)
    with pytest.raises(ValueError, match="density"):
        apply_factorization(model, "sltrain", 8, 16.0, density=0.0)
    assert [n for n, _ in model.named_modules()] == names
    assert not any(isinstance(m, FactorizedLinear) for m in model.modules())
    apply_factorization(model, "lowrank", 8, 16.0, targets=("down_proj",))
    with pytest.raises(ValueError, match="replaced nothing"):  # already factorized
        apply_factorization(model, "lowrank", 8, 16.0, targets=("down_proj",))


@pytest.mark.parametrize("kind", KINDS)
def test_merge_factorized_gives_the_same_logits(llama_config, kind):
    model = _llama(llama_config)
    apply_factorization(model, kind, rank=8, alpha=16.0)
    ids = torch.randint(0, 128, (2, 12))
    _step(model, ids)  # make B nonzero so the low-rank part matters
    with torch.no_grad():
        before = model(ids).logits
        assert merge_factorized_(model) == 14
        after = model(ids).logits
    assert not any(isinstance(m, FactorizedLinear) for m in model.modules())
    assert type(model.model.layers[1].mlp.down_proj) is nn.Linear
    assert torch.allclose(after, before, atol=1e-5, rtol=1e-4)
    assert all(p.requires_grad for p in model.parameters())


def test_refactorization_of_a_factorized_model_keeps_its_function(llama_config):
    model = _llama(llama_config)
    apply_factorization(model, "sltrain", rank=8, alpha=16.0)
    ids = torch.randint(0, 128, (2, 12))
    _step(model, ids)
    values = [m.sparse_values.clone() for m in model.modules() if isinstance(m, SLTrainLinear)]
    with torch.no_grad():
        before = model(ids).logits
        refactorize_(factor_pairs(model))
        after = model(ids).logits
    assert torch.allclose(after, before, atol=1e-5, rtol=1e-4)
    sparse_after = [m.sparse_values for m in model.modules() if isinstance(m, SLTrainLinear)]
    assert all(torch.equal(a, b) for a, b in zip(values, sparse_after))  # sparse part untouched
