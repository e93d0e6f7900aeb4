"""Claims about optimizers.adam_mini.AdamMini (Zhang et al. 2024) beyond the contract
(test_contract.py): step-by-step match with the reference package ``adam-mini`` on a small
LLaMA-like model, the block partition, the state formula, group validation."""

from __future__ import annotations

import contextlib
import io

import harness
import pytest
import torch
from harness import make_grads, roundtrip

import optimizers
from optimizers.adam_mini import AdamMini, num_blocks

#: How the contract runs "adam_mini" (test_contract.py): the toolkit's default groups (matrices one
#: block per row, vectors one block each); head blocks are checked against the reference below.
CONTRACT = harness.Case(
    reduces="does not reduce: its second moment is one scalar per block of at least one row, not per entry",
    variants={"rows": harness.Variant()},
    loss_lr=0.2,
)

DIM, HEADS, KV_HEADS, VOCAB, FFN = 16, 4, 2, 24, 40
HEAD = DIM // HEADS
#: A LLaMA-like model's parameters (HF names), one decoder layer, grouped-query attention.
LLAMA: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (VOCAB, DIM),
    "model.layers.0.self_attn.q_proj.weight": (DIM, DIM),
    "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD, DIM),
    "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD, DIM),
    "model.layers.0.self_attn.o_proj.weight": (DIM, DIM),
    "model.layers.0.mlp.gate_proj.weight": (FFN, DIM),
    "model.layers.0.mlp.up_proj.weight": (FFN, DIM),
    "model.layers.0.mlp.down_proj.weight": (DIM, FFN),
    "model.layers.0.input_layernorm.weight": (DIM,),
    "model.layers.0.post_attention_layernorm.weight": (DIM,),
    "model.norm.weight": (DIM,),
    "lm_head.weight": (VOCAB, DIM),
}


def _llama_params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(0.02 * torch.randn(s, generator=gen)) for n, s in LLAMA.items()}


def _our_groups(params: dict[str, torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """The trainer's groups (effpretrain/optim_setup.py): q and k in a group of head blocks."""
    qk = [p for n, p in params.items() if n.endswith(("q_proj.weight", "k_proj.weight"))]
    mats = [
        p for n, p in params.items() if p.ndim == 2 and not n.endswith(("q_proj.weight", "k_proj.weight"))
    ]
    vecs = [p for p in params.values() if p.ndim == 1]
    return [
        {"params": qk, "weight_decay": weight_decay, "block_rows": HEAD},
        {"params": mats, "weight_decay": weight_decay},
        {"params": vecs, "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_the_adam_mini_package_on_a_llama_layer(weight_decay: float) -> None:
    adam_mini = pytest.importorskip("adam_mini")
    ours, ref = _llama_params(), _llama_params()
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay}
    opt = AdamMini(_our_groups(ours, weight_decay), **kw)
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints what it found
        ref_opt = adam_mini.Adam_mini(
            list(ref.items()), **kw, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, verbose=False
        )
    start = {n: p.detach().clone() for n, p in ref.items()}
    for t in range(12):
        for (n, p), g in zip(ours.items(), make_grads(list(LLAMA.values()), t)):
            p.grad = g.clone()
            ref[n].grad = g.clone()
        opt.step()
        with contextlib.redirect_stdout(io.StringIO()):
            ref_opt.step()
        for n, p in ours.items():
            moved = float((ref[n].detach() - start[n]).abs().max())
            assert float((p.detach() - ref[n].detach()).abs().max()) <= 1e-6 * moved, (t, n)
    # One second moment per head (q: 4, k: 2 key-value heads), per row elsewhere, one per norm.
    v = {n: opt.state[p]["exp_avg_sq"].numel() for n, p in ours.items()}
    assert v["model.layers.0.self_attn.q_proj.weight"] == HEADS
    assert v["model.layers.0.self_attn.k_proj.weight"] == KV_HEADS
    assert v["model.layers.0.self_attn.v_proj.weight"] == KV_HEADS * HEAD
    assert v["model.embed_tokens.weight"] == VOCAB and v["lm_head.weight"] == VOCAB
    assert v["model.layers.0.mlp.down_proj.weight"] == DIM and v["model.norm.weight"] == 1


def test_state_formula_worked_values_and_measured() -> None:
    # s (N + B): N entries of M, B blocks of v.
    for dtype in (torch.float32, torch.bfloat16):
        s = dtype.itemsize
        assert AdamMini.state_bytes((24, 16), {}, dtype) == s * (24 * 16 + 24)
        assert AdamMini.state_bytes((24, 16), {"block_rows": 8}, dtype) == s * (24 * 16 + 3)
        assert AdamMini.state_bytes((7,), {}, dtype) == s * (7 + 1)
        assert AdamMini.state_bytes((7,), {"block_rows": 1}, dtype) == s * (7 + 7)
    params = _llama_params()
    opt = AdamMini(_our_groups(params, 0.0), lr=1e-3)
    for p, g in zip(params.values(), make_grads(list(LLAMA.values()), 0)):
        p.grad = g
    opt.step()
    spec = optimizers.method_spec("adam_mini")
    for group in opt.param_groups:
        for p in group["params"]:
            assert harness.state_bytes_of(opt, p) == spec.state_bytes(tuple(p.shape), group, p.dtype)
    blocks = VOCAB + HEADS + KV_HEADS + KV_HEADS * HEAD + DIM + 2 * FFN + DIM + 3 + VOCAB
    assert optimizers.measured_state_bytes(opt) == 4 * (sum(p.numel() for p in params.values()) + blocks)


def test_block_rows_must_divide_the_rows() -> None:
    with pytest.raises(ValueError, match="block_rows=3"):
        AdamMini([{"params": [torch.nn.Parameter(torch.zeros(8, 4))], "block_rows": 3}])
    with pytest.raises(ValueError, match="block_rows"):
        AdamMini([{"params": [torch.nn.Parameter(torch.zeros(8, 4))], "block_rows": 0}])
    assert num_blocks((8, 4), 4) == 2 and num_blocks((8, 4), None) == 8 and num_blocks((), None) == 1


def test_one_block_per_entry_is_adam() -> None:
    """A vector with ``block_rows=1`` (the reference's rule for biases) is torch's AdamW."""
    w, ref = torch.nn.Parameter(torch.randn(9)), torch.nn.Parameter(torch.randn(9))
    ref.data.copy_(w.data)
    opt = AdamMini([{"params": [w], "block_rows": 1}], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, eps=1e-8, foreach=False)
    for t in range(10):
        g = make_grads([(9,)], t)[0]
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        assert torch.allclose(w, ref, rtol=0, atol=1e-6), t


def test_state_dict_is_weights_only_loadable() -> None:
    params = _llama_params()
    opt = AdamMini(_our_groups(params, 0.0), lr=1e-3)
    for p, g in zip(params.values(), make_grads(list(LLAMA.values()), 0)):
        p.grad = g
    opt.step()
    st = roundtrip(opt.state_dict())["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and type(st["step"]) is int
    assert st["exp_avg_sq"].shape == (HEADS,)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_trainers_groups_match_the_package_on_a_tied_qwen2_with_biases(weight_decay: float) -> None:
    """On a model with q/k/v biases and tied embeddings (Qwen2), the trainer's param groups
    (`build_param_groups`: heads for q and k, plain Adam for every bias, the tied matrix once)
    step as the reference package does with the model's named parameters."""
    adam_mini = pytest.importorskip("adam_mini")
    from effpretrain.config import RunConfig
    from effpretrain.models.llama import ModelShape, build_model
    from effpretrain.optim_setup import build_param_groups

    shape = ModelShape(
        hidden=DIM, intermediate=FFN, heads=HEADS, layers=1, vocab=VOCAB, kv_heads=KV_HEADS,
        tied=True, qkv_bias=True, architecture="Qwen2ForCausalLM",
    )  # fmt: skip
    ours, ref = build_model(shape, seed=0), build_model(shape, seed=0)
    cfg = RunConfig()
    cfg.optim.name, cfg.optim.weight_decay = "adam_mini", weight_decay
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay}
    opt = AdamMini(build_param_groups(ours, cfg), **kw)
    with contextlib.redirect_stdout(io.StringIO()):
        ref_opt = adam_mini.Adam_mini(
            list(ref.named_parameters()), **kw, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, verbose=False
        )
    named = dict(ours.named_parameters())
    ref_named = dict(ref.named_parameters())
    assert "lm_head.weight" not in named  # tied: one parameter
    start = {n: p.detach().clone() for n, p in ref_named.items()}
    for t in range(8):
        for (n, p), g in zip(named.items(), make_grads([p.shape for p in named.values()], t)):
            p.grad, ref_named[n].grad = g.clone(), g.clone()
        opt.step()
        with contextlib.redirect_stdout(io.StringIO()):
            ref_opt.step()
        for n, p in named.items():
            moved = float((ref_named[n].detach() - start[n]).abs().max())
            assert float((p.detach() - ref_named[n].detach()).abs().max()) <= 1e-6 * moved, (t, n)
    v = {n: opt.state[p]["exp_avg_sq"].numel() for n, p in named.items()}
    assert v["model.layers.0.self_attn.q_proj.bias"] == DIM  # a bias: one per entry (Adam)
    assert v["model.layers.0.self_attn.k_proj.bias"] == KV_HEADS * HEAD
    assert v["model.layers.0.self_attn.q_proj.weight"] == HEADS
