"""Distributed claims (2 CPU processes, gloo, torchrun): DDP equals one process at the same global
batch for every method family, resume under 2 processes is exact, and a launch that does not give
the processes it asked for is refused."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from distributed_helpers import COMMON, final, registry_recipes, rel_diff, run_worker_pair

from effpretrain.config import load_config

pytestmark = pytest.mark.multiprocess

# Every registered optimizer and factorized kind (DDP needs nothing method-specific: gradients are
# all-reduced before the step), read from the registries.
METHODS = registry_recipes()
# A projection refresh and a restart (refactorization + momentum reset) inside the resumed half.
RESUME_METHODS = ["galore", "lowrank_restarts"]

WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    root, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    methods, resume_methods, common = sys.argv[4].split(","), sys.argv[5].split(","), sys.argv[6:]
    recipe = lambda m: root / "recipes" / "tiny" / f"{m}.yaml"
    if mode == "one":
        # The same global batch of 4 rows as 2 micro-batches of 2 (one per rank in the DDP run);
        # the validation set (train.eval_tokens) is the same rows for any number of processes.
        for m in methods:
            over = common + ["train.batch_size=2", "train.grad_accum=2"]
            train(load_config(recipe(m), over), out / f"{m}-1p")
        sys.exit(0)
    for m in methods:
        train(load_config(recipe(m), common + ["train.batch_size=2"]), out / f"{m}-2p")
    for m in resume_methods:
        over = common + ["train.batch_size=2", "train.save_every=10"]
        train(load_config(recipe(m), over), out / f"{m}-straight")
        train(load_config(recipe(m), over), out / f"{m}-split",
              resume=str(out / f"{m}-straight" / "checkpoints" / "step-10"))
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process DDP runs (torchrun, gloo) and the 1-process reference runs, side by side.

    Both run with one thread per process (torchrun's default, OMP_NUM_THREADS=1) and the reference
    splits its global batch of 4 into the same 2 micro-batches of 2 that the ranks see. Then every
    floating-point operation matches DDP's (the x2 loss scalings are exact and a two-operand
    all-reduce sum is commutative): SVD-based methods amplify any rounding difference, so this is
    what makes a 1e-5 agreement meaningful rather than lucky.
    """
    out = tmp_path_factory.mktemp("dist")
    run_worker_pair(WORKER, out, [",".join(METHODS), ",".join(RESUME_METHODS), *COMMON])
    return out


@pytest.mark.parametrize("method", METHODS)
def test_ddp_two_processes_equal_one_process_at_same_global_batch(method, runs):
    one = json.loads((runs / f"{method}-1p" / "summary.json").read_text())
    two = json.loads((runs / f"{method}-2p" / "summary.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["tokens"] == one["tokens"]
    assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * abs(one["final_val_loss"])
    assert rel_diff(final(runs / f"{method}-2p"), final(runs / f"{method}-1p")) <= 1e-5


@pytest.mark.parametrize("method", RESUME_METHODS)
def test_resume_under_two_processes_is_exact(method, runs):
    """Bitwise: the resumed run executes the same kernels in the same order as the straight one."""
    a, b = final(runs / f"{method}-straight"), final(runs / f"{method}-split")
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = json.loads((runs / f"{method}-straight" / "summary.json").read_text())
    sb = json.loads((runs / f"{method}-split" / "summary.json").read_text())
    assert sa["final_val_loss"] == sb["final_val_loss"]


def test_single_process_from_a_multi_process_launch_is_refused(monkeypatch):
    """accelerate launch on CPU with a MULTI_CPU config starts one process with MASTER_ADDR set and
    no WORLD_SIZE; silently training one replica would be wrong, so the trainer refuses."""
    from effpretrain.config import ConfigError
    from effpretrain.trainer import check_launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="started a single process"):
        check_launch(1, load_config(None))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="launched 2 processes"):
        check_launch(1, load_config(None))
