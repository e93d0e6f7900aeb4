"""The optimizer contract (docs/architecture.md: the optimizer contract, house style), for every method in `optimizers.METHODS`.

Each registered name is run through the same checks, listed once in `harness.CONTRACT_CHECKS`:
the case decides whether the method reduces to AdamW, determinism, exact resume across a refresh
or reset through weights_only loading, state bytes equal the registry formula, plain state and
untouched param groups, loss goes down, reduce-to-AdamW under degenerate settings, and, for
projecting methods, the zero-gradient dummy step, the refresh schedule, a failed refresh and
group validation. Each check is one test here, parametrized over the methods (ids such as
``[galore-svd-fp32]``); tests/test_registry.py runs the same list on toy methods.

How a method is run (its schedule, variants, degenerate settings) is the module-level
``CONTRACT = harness.Case(...)`` of the method's own test file, tests/optimizers/test_<name>.py, so
adding a method edits no shared test file. A registered method without that file or without its
``CONTRACT`` fails every check here with a message saying what to write: among other things,
whether and how the method reduces to AdamW.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import harness
import pytest

import optimizers

HERE = Path(__file__).resolve().parent


def _test_module(path: Path) -> ModuleType:
    """The test module at `path`, the very object pytest collects.

    tests/optimizers has no __init__.py and the suite uses pytest's default ("prepend") import
    mode, in which pytest imports a test file by its bare stem with this folder on sys.path (as
    tests/conftest.py puts it too): `importlib.import_module` of the stem therefore returns
    pytest's module when it is loaded already and registers the one pytest will reuse otherwise.
    """
    module = importlib.import_module(path.stem)
    found = Path(module.__file__ or "").resolve()
    if found != path:
        raise ImportError(f"module {path.stem!r} is {found}, not {path}")
    return module


def _contract(name: str) -> harness.Case | str:
    """The `CONTRACT` of method `name`'s tests/optimizers/test_<name>.py, or why there is none (the
    failure message of every contract test of the method)."""
    path = HERE / f"test_{name}.py"
    where = f"tests/optimizers/{path.name}"
    what = (
        f"a module-level `CONTRACT = Case(...)` (from harness import Case, Reduction, Variant) saying "
        f"how the contract runs {name!r}: `reduces=` its Reduction rows under which it is "
        f'torch.optim.AdamW, or reduces="does not reduce: <reason>"; plus its variants and schedule'
    )
    if not path.is_file():
        return f"optimizer {name!r} is registered but {where} does not exist: create it with {what}"
    try:
        module = _test_module(path)
    except (Exception, pytest.skip.Exception) as err:
        return f"optimizer {name!r}: importing {where} failed ({type(err).__name__}: {err}), so it has no CONTRACT"
    case = getattr(module, "CONTRACT", None)
    if not isinstance(case, harness.Case):
        return f"optimizer {name!r} is registered but {where} has no CONTRACT: add {what}"
    return case


CONTRACTS: dict[str, harness.Case | str] = {name: _contract(name) for name in sorted(optimizers.METHODS)}


def _params(check: harness.ContractCheck) -> list:
    """`check`'s runs over the registered methods; a method without a CONTRACT gets one failing run."""
    params = []
    for name, case in CONTRACTS.items():
        if not check.applies(name):
            continue
        if isinstance(case, str):
            params.append(pytest.param(functools.partial(pytest.fail, case, pytrace=False), id=name))
        else:
            params += [pytest.param(call, id=run_id) for run_id, call in check.runs(name, case)]
    return params


def _contract_test(check: harness.ContractCheck) -> Callable[[Callable[[], None]], None]:
    @pytest.mark.parametrize("run", _params(check))
    def test(run: Callable[[], None]) -> None:
        run()

    test.__name__ = test.__qualname__ = check.test
    test.__doc__ = check.check.__doc__
    return test


# One test per contract check, made from the single list (so nothing here can fall out of step with
# what tests/test_registry.py runs); pytest collects them by these names.
for _check in harness.CONTRACT_CHECKS:
    globals()[_check.test] = _contract_test(_check)
