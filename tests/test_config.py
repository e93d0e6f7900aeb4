"""Config claims: strict schema, typed overrides, errors that name key and file."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from _common import ROOT

import optimizers
from effpretrain.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    config_hash,
    config_table,
    field_docs,
    load_config,
    validate,
)
from effpretrain.errors import ConfigError as ErrorsConfigError


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
        "train.eval_tokens",
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
        ("model:\n  preset: llama_70b\n", "model.preset='llama_70b' is not one of"),
        ("train:\n  in_backward_refresh: first_micro\n", "first_micro needs train.update_in_backward=true"),
        (
            "train:\n  in_backward_refresh: first_micro\n  update_in_backward: true\n",
            "first_micro needs train.grad_clip=0",
        ),
        (
            "train:\n  in_backward_refresh: first_micro\n  update_in_backward: true\n  grad_clip: 0\n"
            "dist:\n  sharding: fsdp2\n",
            "does not apply under dist.sharding=fsdp2",
        ),
        ("train:\n  warmup_ratio: 1.5\n", "train.warmup_ratio=1.5 must be in [0, 1]"),
        ("data:\n  source: files\n", "data.path is required"),
        ("data:\n  source: files\n  path: nowhere/x.txt\n", "data.path not found"),
        ("- a\n- b\n", "must be a mapping"),
        ("optim: [1, 2]\n", "optim must be a mapping"),
        # Huge and non-finite numbers, booleans for numbers, YAML values Python refuses.
        ("optim:\n  lr: 1e999\n", "optim.lr='1e999' must be a finite number"),
        ("optim:\n  lr: 1.0e+999\n", "optim.lr=inf must be a finite number"),
        ("optim:\n  weight_decay: .nan\n", "optim.weight_decay=nan must be a finite number"),
        ("optim:\n  lr: " + "9" * 400 + "\n", "must be a finite number"),
        ("train:\n  max_steps: " + str(10**40) + "\n", "is out of range (a 64-bit integer)"),
        ("train:\n  seed: 4294967296\n", "train.seed=4294967296 must be in [0, 2**32)"),
        ("train:\n  max_steps: " + "1" * 5000 + "\n", "not valid YAML"),
        ("optim:\n  lr: true\n", "optim.lr=True has the wrong type"),
        ("train:\n  plot: 1\n", "train.plot=1 has the wrong type"),
        ("data:\n  name: 2024-13-45\n", "not valid YAML"),
        ("data:\n  name: 2024-01-05\n", "data.name=datetime.date(2024, 1, 5) has the wrong type"),
        # Wrong nesting, choices in lists, free-form values that are not plain data.
        ("lr: 0.001\n", "unknown key 'lr'"),
        ("optim:\n  lr:\n    value: 0.001\n", "optim.lr={'value': 0.001} has the wrong type"),
        ("optim:\n  targets: q_proj\n", "optim.targets='q_proj' has the wrong type (expected a list)"),
        ("train:\n  trackers: [mlflow]\n", "train.trackers[0]='mlflow' is not one of tensorboard, wandb"),
        ("optim:\n  extra: {when: 2024-01-05}\n", "optim.extra.when=datetime.date"),
        ("optim:\n  extra: {1: 2}\n", "optim.extra key=1 has the wrong type"),
        ("optim:\n  proj_type: sideways\n", "optim.proj_type='sideways' is not one of std, reverse_std"),
        ("optim:\n  lr: 0.1\n  lr: 0.2\n", "duplicate key 'lr'"),
        ("[" * 5000 + "]" * 5000 + "\n", "not valid YAML (nested too deeply)"),
        # Not a recipe at all.
        ("", "recipe is empty"),
        ("# only a comment\n", "recipe is empty"),
        ("just words\n", "a recipe must be a mapping of sections, got 'just words'"),
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


def test_recipe_file_problems_are_config_errors(tmp_path, monkeypatch):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("optim:\n  name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text \(byte 18: b'\\xe9'\)"):
        load_config(bad)
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="recipe not found"):
        load_config(tmp_path / "missing.yaml")
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfoptim:\n  lr: 0.01\n")  # UTF-8 with a byte-order mark is text
    assert load_config(bom).optim.lr == 0.01
    # Unreadable: simulated, since chmod does not stop root (CI containers run as root).
    unreadable = tmp_path / "unreadable.yaml"
    unreadable.write_text("{}\n")

    def refuse(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(ConfigError, match="cannot read recipe .*unreadable.yaml: Permission denied"):
        load_config(unreadable)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lr=.inf", "optim.lr=inf must be a finite number"),
        ("optim.lr=1e999", "optim.lr='1e999' must be a finite number"),
        ("optim.beta1=.nan", "optim.beta1=nan must be a finite number"),
        ("optim.lr={a: 1}", "optim.lr={'a': 1} has the wrong type"),
        ("optim={lr: 1, nam: adamw}", "unknown key 'optim.nam'"),
        ("optim=3", "optim must be a mapping, got 3"),
        ("optim.lr.x=3", "optim.lr={'x': 3} has the wrong type"),
        ("optim.lr=[1", "cannot parse value of 'optim.lr' (line 1, column 3"),
        ("optim.extra={a: 1, a: 2}", "duplicate key 'a'"),
        ("optim.extra=!!python/name:os.system", "cannot parse value of 'optim.extra'"),
        ("=3", "unknown key ''"),
        ("train.max_steps=" + str(2**63), "is out of range (a 64-bit integer)"),
        ("train.trackers=[wandb, comet]", "train.trackers[1]='comet' is not one of"),
        ("optim\n.lr=3", "unknown key 'optim\\n'"),
    ],
)
def test_bad_overrides_are_config_errors(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)  # one line, whatever the key held


def test_config_error_is_one_line_and_one_class():
    assert ErrorsConfigError is ConfigError
    assert str(ConfigError("a\n  b\r\nc\n")) == "a b c"


def test_validate_checks_programmatic_configs():
    cfg = RunConfig()
    cfg.optim.weight_decay = math.nan  # nan < 0 is False: a plain range check would let it through
    with pytest.raises(ConfigError, match="optim.weight_decay=nan must be a finite number"):
        validate(cfg)
    cfg = RunConfig()
    cfg.train.trackers = ["tensorboard", "neptune"]
    with pytest.raises(ConfigError, match=r"train.trackers\[1\]='neptune' is not one of"):
        validate(cfg)
    cfg = RunConfig()
    cfg.restarts.recovery_steps = -1
    with pytest.raises(ConfigError, match="restarts.recovery_steps=-1 must be >= 0"):
        validate(cfg)


def test_registry_choices_follow_the_registry_at_run_time():
    with pytest.raises(ConfigError, match="optim.name='toy_sgd' is not one of"):
        load_config(None, ["optim.name=toy_sgd"])
    optimizers.register(optimizers.MethodSpec(name="toy_sgd", target="torch.optim:SGD"))
    try:
        assert load_config(None, ["optim.name=toy_sgd"]).optim.name == "toy_sgd"
    finally:
        optimizers.unregister("toy_sgd")
    with pytest.raises(ConfigError, match="factor.kind='dense' is not one of none, lowrank"):
        load_config(None, ["factor.kind=dense"])


def _config_classes():
    classes = [RunConfig]
    for f in dataclasses.fields(RunConfig):
        value = getattr(RunConfig(), f.name)
        if dataclasses.is_dataclass(value):
            classes.append(type(value))
    return classes


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda c: c.__name__)
def test_every_key_has_a_docstring(cls):
    docs = field_docs(cls)
    keys = [f.name for f in dataclasses.fields(cls)]
    assert keys and all(docs.get(k) for k in keys), sorted(set(keys) - set(docs))


def test_config_reference_is_generated_from_the_schema():
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    expected = config_table()
    assert page.endswith(expected), (
        "docs/reference/config.md is out of date; regenerate it with: python -m effpretrain.reference"
    )
    assert expected.count("\n| `") == sum(1 for _ in _config_keys())


def _config_keys():
    for cls in _config_classes():
        yield from (
            f.name for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(getattr(cls(), f.name))
        )


def test_eval_batches_is_refused_naming_its_replacement(tmp_path, capsys):
    """train.eval_batches (rows per process: a different set on every process count) was replaced
    by train.eval_tokens; a recipe or override still carrying it gets one line naming the
    replacement and exit code 2, never a silent translation."""
    from effpretrain.cli import main

    p = write(tmp_path, "train:\n  eval_batches: 40\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}: train.eval_batches was replaced by train.eval_tokens")
    with pytest.raises(ConfigError, match="train.eval_batches was replaced by train.eval_tokens"):
        load_config(None, ["train.eval_batches=4"])
    assert main(["train", str(p), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.eval_batches was replaced by train.eval_tokens" in err
    assert not (tmp_path / "run").exists()


def test_optim_extra_cannot_override_a_typed_optim_key(tmp_path):
    """A constructor keyword in optim.extra would win over the typed key (the recipe would say one
    learning rate and the run train with another): refused, naming the key to set instead."""
    p = write(tmp_path, "optim:\n  name: galore\n  lr: 0.01\n  extra: {lr: 0.5}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}: optim.extra.lr would override optim.lr; set that key instead"
    with pytest.raises(ConfigError, match="optim.extra.betas would override optim.beta1 and optim.beta2"):
        load_config(None, ["optim.extra={betas: [0.9, 0.95]}"])
    assert load_config(None, ["optim.extra={gamma1: 0.7}"]).optim.extra == {"gamma1": 0.7}
