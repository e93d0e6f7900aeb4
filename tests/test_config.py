"""Config claims: strict schema, typed overrides, errors that name key and file."""

from __future__ import annotations

import pytest

from effpretrain.config import ConfigError, RunConfig, apply_overrides, config_hash, load_config


def write(tmp_path, text, name="recipe.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_load_and_method_from_stem(tmp_path):
    cfg = load_config(write(tmp_path, "optim:\n  name: adamw\n", "my_method.yaml"))
    assert isinstance(cfg, RunConfig)
    assert cfg.method == "my_method"
    assert cfg.data.source == "builtin"


def test_every_issue_key_exists():
    cfg = RunConfig()
    for key in [
        "model.preset",
        "optim.name",
        "optim.lr",
        "optim.weight_decay",
        "data.source",
        "data.path",
        "data.name",
        "data.tokenizer",
        "data.seq_len",
        "train.max_steps",
        "train.batch_size",
        "train.grad_accum",
        "train.warmup_ratio",
        "train.min_lr_ratio",
        "train.eval_every",
        "train.eval_batches",
        "train.save_every",
        "train.seed",
        "train.precision",
        "train.activation_checkpointing",
    ]:
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key


@pytest.mark.parametrize(
    "text, needle",
    [
        ("optim:\n  nam: adamw\n", "unknown key 'optim.nam'"),
        ("optimizer:\n  name: adamw\n", "unknown key 'optimizer'"),
        ("optim:\n  lr: fast\n", "optim.lr='fast' has the wrong type"),
        ("train:\n  max_steps: 1.5\n", "train.max_steps=1.5 has the wrong type"),
        ("train:\n  batch_size: true\n", "train.batch_size=True has the wrong type"),
        ("optim:\n  lr: -0.001\n", "optim.lr=-0.001 must be > 0"),
        ("train:\n  precision: fp16\n", "train.precision='fp16' is not one of"),
        ("optim:\n  name: sgdx\n", "optim.name='sgdx' is not one of"),
        ("model:\n  preset: llama_7b\n", "model.preset='llama_7b' is not one of"),
        ("train:\n  warmup_ratio: 1.5\n", "train.warmup_ratio=1.5 must be in [0, 1)"),
        ("data:\n  source: files\n", "data.path is required"),
        ("data:\n  source: files\n  path: nowhere/x.txt\n", "data.path not found"),
        ("- a\n- b\n", "must be a mapping"),
        ("optim: [1, 2]\n", "optim must be a mapping"),
    ],
)
def test_bad_recipes_name_key_and_file(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert needle in str(e.value)
    assert str(p) in str(e.value)


def test_overrides_typed_and_strict():
    cfg = RunConfig()
    apply_overrides(cfg, ["optim.lr=3e-4", "train.max_steps=7", "optim.targets=[q_proj, v_proj]"])
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_steps == 7
    assert cfg.optim.targets == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="unknown key 'train.max_step'"):
        apply_overrides(cfg, ["train.max_step=3"])
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides(cfg, ["train.max_steps"])
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config(None, ["optim.lr=0"])


def test_activation_checkpointing_accepts_bool_and_k():
    assert load_config(None, ["train.activation_checkpointing=true"]).train.activation_checkpointing == 1
    assert load_config(None, ["train.activation_checkpointing=2"]).train.activation_checkpointing == 2


def test_config_hash_changes_with_content():
    a, b = RunConfig(), RunConfig()
    assert config_hash(a) == config_hash(b)
    b.optim.lr = 1.0
    assert config_hash(a) != config_hash(b)
