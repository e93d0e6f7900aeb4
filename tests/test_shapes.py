"""Model shapes drawn, not picked: for any config of a supported family the estimator counts the
model the trainer builds.

Hypothesis draws ``config.json`` files as a user writes them, of every supported family (LLaMA,
Mistral, Qwen2, Qwen3): width, query heads, key/value heads (a divisor of the heads), a head size
left out, stated equal to width / heads or stated otherwise, tied or untied embeddings,
``attention_bias`` and (where the class ignores it) ``mlp_bias`` stated either way, MLP width,
layers and vocabulary; small, so that a model builds in milliseconds. For each one:

- the shape read from it (``model_shape``: what the estimator, FLOPs and preflight see) round-trips
  through its own HF config (``shape_of(shape.hf_config()) == shape``), and the model rebuilt from
  that shape (`model_param_shapes`, the estimator's parameters) has the real model's parameters,
  name by name and shape by shape;
- the real model, built by the trainer's own code (`build_run_model` from ``model.config``, the
  trainer's param groups and optimizer, one step on a tiny batch), has the estimate's parameter
  count, weight bytes and optimizer state bytes (`optimizers.measured_state_bytes`), for a projected
  method (GaLore), a whole-matrix one (Muon) and a block-wise one with a block per head (Adam-mini,
  whose state depends on the head size itself).

A user's Qwen3 (width 128, 4 heads, head size 32 = 128 / 4) is an explicit example: its shape once
dropped the head size as redundant and the rebuilt config took Qwen3's default of 128.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from _common import TINY
from hypothesis import HealthCheck, example, given, note, seed, settings
from hypothesis import strategies as st

import optimizers
from effpretrain.checkpoint.weights import without_aliases
from effpretrain.config import load_config
from effpretrain.errors import ConfigError
from effpretrain.memory import estimate_from_config
from effpretrain.memory.terms import model_param_shapes
from effpretrain.models.llama import ARCHITECTURES, model_shape, shape_of
from effpretrain.optim_setup import build_optimizer_and_schedule
from effpretrain.run_model import build_run_model, make_train_step, synthetic_batch

#: Projected, whole-matrix, block-wise by head.
METHODS = ["galore", "muon", "adam_mini"]
#: Every override keeps the step tiny; rank 2 fits the narrowest projected matrix drawn (kv x head
#: size >= 1 x 4).
OVERRIDES = ["data.seq_len=8", "train.batch_size=1", "optim.rank=2", "data.shuffle_buffer=0"]

SHAPES = settings(
    max_examples=12,  # per family and method: 48 shapes per method
    deadline=None,
    database=None,  # with the fixed seed below: the same shapes on every run, so CI is deterministic
    suppress_health_check=[HealthCheck.too_slow],
)

#: A reported Qwen3: head size 32 = 128 / 4; 2,466,560 parameters, once estimated at
#: 2,761,856 (head size 128, Qwen3's default).
USERS_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 8192,
    "tie_word_embeddings": False,
}


@st.composite
def hf_configs(draw: st.DrawFn, arch: str) -> dict[str, Any]:
    """A ``config.json`` of the `arch` family, as a user writes it."""
    model_type = ARCHITECTURES[arch]
    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    natural = draw(st.sampled_from([4, 8, 16]))  # width / heads
    d: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": heads * natural,
        "intermediate_size": draw(st.sampled_from([8, 24, 40])),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": draw(st.integers(1, 2)),
        "vocab_size": draw(st.sampled_from([32, 96])),
        "tie_word_embeddings": draw(st.booleans()),
        "attention_bias": draw(st.booleans()),  # Qwen2 (always) and Mistral (never) ignore it
    }
    head_dim = draw(st.sampled_from(["left out", "width / heads", 4, 12, 24]))
    if head_dim == "width / heads":
        d["head_dim"] = natural
    elif head_dim != "left out":
        d["head_dim"] = head_dim
    if model_type != "llama":  # LLaMA's mlp_bias=true is refused (below); the others ignore it
        d["mlp_bias"] = draw(st.booleans())
    return d


def _write(root: Path, config: dict[str, Any]) -> Path:
    """`config` as ``config.json`` in a folder named by its content (configs are read once per
    source and cached, so one folder must never hold two configs)."""
    text = json.dumps(config, sort_keys=True)
    folder = root / hashlib.sha256(text.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(text)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shapes")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_estimate_counts_the_model_the_trainer_builds(root, arch, method):
    # Each family is drawn on its own, so that every one gets its share of shapes; a seed of its
    # own per family and method (fixed: the same shapes on every run) so that they differ.
    users = example(config=USERS_QWEN3) if arch == "Qwen3ForCausalLM" else (lambda f: f)

    @seed(zlib.crc32(f"{arch} {method}".encode()))
    @settings(SHAPES)
    @users
    @given(config=hf_configs(arch))
    def check(config: dict[str, Any]) -> None:
        note(json.dumps(config))
        _check(root, method, config)

    check()


def _check(root: Path, method: str, config: dict[str, Any]) -> None:
    path = _write(root, config)
    cfg = load_config(TINY / f"{method}.yaml", [f"model.config={path}", *OVERRIDES])
    vocab = config["vocab_size"]
    model, _ = build_run_model(cfg, vocab)
    shape = model_shape(cfg.model)

    # The shape is the config's: it round-trips, and the model rebuilt from it is the real one.
    assert shape_of(shape.hf_config()) == shape
    rebuilt = [(s.name, s.shape) for s in model_param_shapes(shape, vocab)]
    assert rebuilt == [(n, tuple(p.shape)) for n, p in model.named_parameters()]

    # The trainer's param groups and optimizer; one step makes every state tensor.
    opt, sched = build_optimizer_and_schedule(model, cfg)
    make_train_step(model, opt, cfg, lambda k: synthetic_batch(cfg, vocab, seed=k), sched=sched)()
    est = estimate_from_config(cfg, vocab)
    assert est.params == sum(p.numel() for p in model.parameters())  # a tied matrix once
    weights = without_aliases(model.state_dict())  # as the trainer's summary counts them
    assert est.weights == sum(v.numel() * v.element_size() for v in weights.values())
    assert est.optimizer_state == optimizers.measured_state_bytes(opt)


def test_the_users_qwen3_is_counted_at_its_size(root):
    """Issue 36's numbers: the user's Qwen3 has 2,466,560 parameters and the estimate says so."""
    cfg = load_config(TINY / "adamw.yaml", [f"model.config={_write(root, USERS_QWEN3)}", *OVERRIDES])
    with torch.device("meta"):
        model, _ = build_run_model(cfg, 8192)
    assert sum(p.numel() for p in model.parameters()) == 2_466_560
    assert estimate_from_config(cfg, 8192).params == 2_466_560


def test_a_llama_with_mlp_biases_is_refused_in_one_line(root):
    """The estimator's LLaMA has a bias-free MLP; a config with ``mlp_bias: true`` would train
    biases it does not count, so it is refused (the other families' classes ignore the key)."""
    config = {**USERS_QWEN3, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": True}
    cfg = load_config(TINY / "adamw.yaml", [f"model.config={_write(root, config)}", *OVERRIDES])
    with pytest.raises(
        ConfigError, match=r"^model.config: LlamaForCausalLM with mlp_bias=true is not supported"
    ):
        model_shape(cfg.model)
