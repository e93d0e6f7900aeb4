"""Checkpoint helpers: the one weight loader, the one "run or checkpoint" resolver, keyword-only
saves, and sharded optimizer state keyed by parameter name."""

from __future__ import annotations

import inspect

import pytest
import torch

from effpretrain.checkpoint import (
    complete_checkpoints,
    load_checkpoint,
    load_model_weights,
    resolve_checkpoint,
    save_checkpoint,
    sharded,
)
from effpretrain.config import ConfigError
from effpretrain.models import build_model


def _tiny(vocab: int = 64) -> torch.nn.Module:
    return build_model("tiny", vocab_size=vocab, max_positions=16)


def test_load_model_weights_exact_and_ignores_rebuilt_buffers():
    src, dst = _tiny(), build_model("tiny", vocab_size=64, max_positions=16, seed=1)
    weights = dict(src.state_dict())
    weights["model.rotary_emb.inv_freq"] = dst.model.rotary_emb.inv_freq.clone()  # non-persistent
    load_model_weights(dst, weights, "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda w: w.pop("model.norm.weight"), "missing ['model.norm.weight']"),
        (lambda w: w.update({"model.extra.weight": torch.zeros(1)}), "unexpected ['model.extra.weight']"),
        (lambda w: w.update({"lm_head.weight": torch.zeros(3, 128)}), "size mismatch for lm_head.weight"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_load_model_weights_mismatch_is_one_line_naming_the_checkpoint(tmp_path, change, needle):
    weights = dict(_tiny().state_dict())
    change(weights)
    with pytest.raises(ConfigError) as e:
        load_model_weights(_tiny(), weights, tmp_path / "step-7")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {tmp_path / 'step-7'} does not match the model")
    assert needle in msg


def _save(root, step, **kw):
    return save_checkpoint(root, step, trainer_state={"step": step}, config_yaml="x: 1\n", **kw)


def test_save_checkpoint_takes_keywords_after_root_and_step(tmp_path):
    params = inspect.signature(save_checkpoint).parameters
    assert [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == ["ckpt_root", "step"]
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, None, None, {"step": 1}, "x: 1\n")  # the old positional call
    model = _tiny()
    path = _save(tmp_path / "checkpoints", 1, model_state=model.state_dict(), optimizer_state={"state": {}})
    state = load_checkpoint(path)
    assert state["trainer"] == {"step": 1} and state["optimizer"] == {"state": {}}
    load_model_weights(_tiny(), state["model"], path)


def test_resolve_checkpoint_run_dir_or_folder(tmp_path):
    run = tmp_path / "run"
    for step in (2, 4):
        _save(run / "checkpoints", step, model_state={"w": torch.zeros(1)}, optimizer_state={})
    newest = complete_checkpoints(run / "checkpoints")[-1]
    assert resolve_checkpoint(run, "eval") == newest == resolve_checkpoint(str(newest), "eval")
    with pytest.raises(ConfigError, match=r"^eval: .*nope does not exist$"):
        resolve_checkpoint(tmp_path / "nope", "eval")
    with pytest.raises(ConfigError, match=r"^export: .* is not a complete checkpoint folder$"):
        resolve_checkpoint(tmp_path, "export")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^export: .*empty holds no complete checkpoint$"):
        resolve_checkpoint(tmp_path / "empty", "export")


def test_sharded_optimizer_state_is_keyed_by_parameter_name():
    """Saved state names its parameters; loading maps each name to that parameter's position in the
    loading optimizer, even when its groups list the parameters in another order."""
    model = _tiny()
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim == 1]
    opt = torch.optim.AdamW([{"params": mats}, {"params": vecs, "weight_decay": 0.0}], lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    saved = sharded._keyed_by_name(opt.state_dict(), sharded._param_names(model, opt))
    names = dict(model.named_parameters())
    assert set(saved["state"]) == set(names)
    assert saved["param_groups"][1]["params"] == [n for n, p in names.items() if p.ndim == 1]

    other = torch.optim.AdamW([{"params": mats[::-1]}, {"params": vecs[::-1], "weight_decay": 0.0}], lr=1e-3)
    other.load_state_dict(sharded._keyed_by_index(saved, sharded._param_names(model, other)))
    for p in model.parameters():
        assert torch.equal(other.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    assert other.param_groups[1]["weight_decay"] == 0.0

    fewer = torch.optim.AdamW([{"params": mats[1:]}, {"params": vecs, "weight_decay": 0.0}], lr=1e-3)
    first = next(n for n, p in names.items() if p is mats[0])
    with pytest.raises(ValueError, match=rf"param group 0 holds {len(mats)} parameters in the checkpoint, "
                       rf"{len(mats) - 1} here \({first} is in only one\)"):  # fmt: skip
        sharded._keyed_by_index(saved, sharded._param_names(model, fewer))


def test_resume_compares_keys_newer_than_the_checkpoint_at_their_defaults():
    """A checkpoint written before a config key existed (``model.config``,
    ``train.in_backward_refresh``) resumes: the key behaved as its default there. Changing such a
    key from its default is still refused."""
    from effpretrain.config import RunConfig, to_dict
    from effpretrain.run_state import RunFacts

    old = to_dict(RunConfig())
    del old["model"]["config"], old["train"]["in_backward_refresh"]
    RunFacts(RunConfig(), 1, "none", False)._check_compatible(old)
    changed = RunConfig()
    changed.train.update_in_backward, changed.train.grad_clip = True, 0.0
    changed.train.in_backward_refresh = "first_micro"
    saved = to_dict(changed)
    saved["train"]["in_backward_refresh"] = "accumulated"
    with pytest.raises(ConfigError, match="train.in_backward_refresh: 'accumulated' -> 'first_micro'"):
        RunFacts(changed, 1, "none", False)._check_compatible(saved)
