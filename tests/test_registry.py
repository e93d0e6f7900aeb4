"""A method registered at run time is picked up everywhere with no other edit.

Adding a method is one optimizer class, one `optimizers.register(MethodSpec(...))` row (or a row in
`optimizers.METHODS`), recipes and its own test file (holding its contract `Case` as ``CONTRACT``).
Here two toy methods are registered from this module (a momentum SGD, and a projecting GaLore
subclass) and each is accepted by config validation, counted by the memory estimator with its own
formula, trained by the trainer (measured state == estimate) and run through every check of the
optimizer contract (`harness.CONTRACT_CHECKS`, the list tests/optimizers/test_contract.py runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import harness  # tests/optimizers/harness.py (on the path via tests/conftest.py)
import pytest
import torch

import optimizers
from effpretrain.config import ConfigError, OptimConfig, load_config
from effpretrain.memory import estimate
from effpretrain.trainer import train
from optimizers._matrix import MatrixOptimizer
from optimizers.galore import GaLoreAdamW


class ToySGD(torch.optim.Optimizer):
    """SGD with heavy-ball momentum and decoupled weight decay:
    B <- beta1 B + G;  W <- W (1 - eta lambda) - eta B.

    Takes the toolkit's common Adam keywords (``betas``: beta1 is the momentum; ``eps`` unused).
    State per parameter: ``momentum_buffer`` (B), the parameter's shape and dtype.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """``numel * itemsize``: the momentum buffer."""
        return math.prod(shape) * dtype.itemsize

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["momentum_buffer"] = torch.zeros_like(p)
                buf = st["momentum_buffer"].mul_(group["betas"][0]).add_(p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(buf, alpha=-group["lr"])
        return loss


class ToySign(MatrixOptimizer):
    """A whole-matrix method written as its rule alone, on the attention/MLP weights (AdamW on the
    rest): the gradient scaled by the whole matrix's RMS over its largest entry,
    W <- W (1 - eta lambda) - eta G rms(G) / max|G|. The shared base gives it the param groups,
    AdamW, the placement under FSDP2, the state formula (stateless matrices) and the contract."""

    def _matrix_update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        scale = g.pow(2).mean().sqrt() / g.abs().max().clamp_min(1e-30)
        p.mul_(1.0 - group["lr"] * group["weight_decay"]).add_(g * scale, alpha=-group["lr"])


class ToyProjected(GaLoreAdamW):
    """A projecting method: GaLore under another name (its own class, so the registry must carry
    it: nothing in the toolkit knows this class)."""


TOY_SGD = optimizers.MethodSpec(name="toy_sgd", target=f"{__name__}:ToySGD")
TOY_PROJECTED = optimizers.MethodSpec(name="toy_projected", target=f"{__name__}:ToyProjected", projects=True)
TOY_SIGN = optimizers.MethodSpec(name="toy_sign", target=f"{__name__}:ToySign", matrix_params="hidden")
TOYS = (TOY_SGD, TOY_PROJECTED, TOY_SIGN)
#: How the contract runs the toys (a real method's is the CONTRACT of its tests/optimizers/test_<name>.py).
CONTRACTS = {
    "toy_sgd": harness.Case(
        reduces="does not reduce: SGD keeps no second moment", state_keys=("momentum_buffer",), loss_lr=0.15
    ),
    "toy_sign": harness.Case(
        reduces="does not reduce: sign descent is not Adam's rule",
        state_keys=("step",),
        loss_lr=1.0,
        loss_steps=100,
    ),
    "toy_projected": harness.Case(
        reduces=(
            harness.Reduction(
                "torch_convention",
                {"lr": 1e-2, "eps": 1e-6},
                {"adam_convention": "torch"},
                "identity",
                steps=6,
            ),
        ),
        loss_lr=0.5,
        loss_steps=50,
    ),
}


@pytest.fixture
def toys():
    """The toys registered for one test, unregistered after it."""
    assert not any(spec.name in optimizers.METHODS for spec in TOYS)
    with pytest.raises(ConfigError, match="optim.name='toy_sgd' is not one of"):
        load_config(None, ["optim.name=toy_sgd"])
    for spec in TOYS:
        optimizers.register(spec)
    yield
    for spec in TOYS:
        optimizers.unregister(spec.name)


def test_register_rejects_a_taken_name(toys) -> None:
    with pytest.raises(ValueError, match="already registered"):
        optimizers.register(TOY_SGD)
    assert optimizers.ToySGD is ToySGD  # registered classes are importable from optimizers by name


def test_config_validation_accepts_a_registered_method(toys) -> None:
    cfg = load_config(None, ["optim.name=toy_sgd"])
    assert cfg.optim.name == "toy_sgd" and cfg.method == "toy_sgd"


def test_estimator_counts_the_toys_state_with_its_formula(toys) -> None:
    est = estimate("tiny", "toy_sgd", dtype="fp32")
    # One fp32 buffer per trainable parameter: exactly the weights' bytes.
    assert est.optimizer_state == est.weights == 4 * est.trainable_params
    # A projecting toy gets projected groups: GaLore's formula with its group keys.
    o = {"rank": 16, "update_proj_gap": 10}
    toy = estimate("tiny", "toy_projected", dtype="fp32", optim_cfg=OptimConfig(name="toy_projected", **o))
    galore = estimate("tiny", "galore", dtype="fp32", optim_cfg=OptimConfig(name="galore", **o))
    adamw = estimate("tiny", "adamw", dtype="fp32")
    assert toy.optimizer_state == galore.optimizer_state < adamw.optimizer_state


@pytest.mark.parametrize("name", ["toy_sgd", "toy_projected", "toy_sign"])
def test_trainer_trains_a_registered_method(toys, name: str, tmp_path, tiny_overrides) -> None:
    over = [*tiny_overrides, "train.max_steps=3", "train.eval_every=3", f"optim.name={name}", "optim.rank=16"]
    summary = train(load_config(None, over), tmp_path / "run")
    assert summary["steps"] == 3 and math.isfinite(summary["final_val_loss"])
    assert summary["optimizer_state_bytes"] == summary["estimated"]["optimizer_state"]
    if optimizers.METHODS[name].projects or optimizers.METHODS[name].matrix_params:
        # The param-group rules projected (or gave the stateless rule) the attention/MLP weights:
        # far below AdamW's 2x weights.
        assert summary["optimizer_state_bytes"] < summary["weight_bytes"]
    else:
        assert summary["optimizer_state_bytes"] == summary["weight_bytes"]  # its formula: one buffer


@pytest.mark.parametrize("name", ["toy_sgd", "toy_projected", "toy_sign"])
def test_contract_checks_accept_a_registered_method(toys, name: str) -> None:
    """Every contract check test_contract.py runs for a registered method passes for the toy."""
    done = harness.run_contract(name, CONTRACTS[name])
    checks = {run.split("[")[0] for run in done}
    # Each check that applies ran at least once (the toy SGD reduces to nothing, so it has no
    # reduction run; it does not project, so the projected checks do not apply).
    skipped = {"test_reduces_to_torch_adamw"} if name in ("toy_sgd", "toy_sign") else set()
    assert checks == {c.test for c in harness.CONTRACT_CHECKS if c.applies(name)} - skipped
