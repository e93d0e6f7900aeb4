"""`train.update_in_backward` under 2 CPU processes (gloo, torchrun): DDP (no DDP wrapper: each
final gradient is averaged over the ranks in its hook) and FSDP2 (the hooks run on each sharded
parameter right after its reduce-scatter, every micro-step) end equal to one process in the same
mode at the same global batch, with clipping off and on (the previous step's norm, the same
number in every mode: with clipping on GaLore keeps full accumulators, see in_backward.py);
DDP in this mode is bitwise DDP's own path for adamw; a ReLoRA warm start's switch keeps the DDP
ranks identical; resume under FSDP2 in this mode is exact. The methods are read from the
registry: one per in-backward kind (`_methods`).

Each parity test prints its relative weight difference (`pytest -rP` shows them).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import yaml
from _common import IN_BACKWARD_KINDS, ROOT, assert_resumed_from, in_backward_kind
from distributed_helpers import COMMON, final, registry_recipes, rel_diff, run_worker_pair, selected

import optimizers

pytestmark = pytest.mark.multiprocess


def _methods() -> list[str]:
    """Read from the registry: the first registered method of each in-backward kind (element-wise
    AdamW; whole-matrix steps on owner ranks under FSDP2, as adamw_8bit's; a basis with full
    accumulators, Fira; GaLore's low-rank accumulators), then the factorized model with restarts."""
    first = {}
    for method in optimizers.METHODS:
        first.setdefault(in_backward_kind(method), method)
    assert first.keys() == set(IN_BACKWARD_KINDS), first
    factorized = next(stem for stem in registry_recipes() if stem not in optimizers.METHODS)
    return [first[kind] for kind in IN_BACKWARD_KINDS] + [factorized]


METHODS = _methods()
CLIPS = {"noclip": "0", "clip": "0.05"}  # 0.05: far below every step's norm here, so it bites
MODES = ["ddp", "fsdp2"]

WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    root, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    methods, clips, common = sys.argv[4].split(","), dict(c.split("=") for c in sys.argv[5].split(",")), sys.argv[6:]
    recipe = lambda m: root / "recipes" / "tiny" / f"{m}.yaml"
    common = common + ["train.update_in_backward=true", "train.grad_accum=4"]
    warm = ["train.grad_clip=0.05", "factor.warm_start_steps=5"]  # ReLoRA: switch after step 5
    if mode == "one":
        # Micro-batch k of 4 rows is the union of the two ranks' micro-batch k (2 rows each).
        for m in methods:
            for tag, clip in clips.items():
                over = common + ["train.batch_size=4", f"train.grad_clip={clip}"]
                train(load_config(recipe(m), over), out / f"{m}-{tag}-1p")
        train(load_config(recipe("relora"), common + warm + ["train.batch_size=4"]), out / "relora-warm-1p")
        sys.exit(0)
    import torch
    from effpretrain.trainer import Trainer

    # DDP's own path (a DDP wrapper, one all-reduce per bucket after backward), to compare bits.
    over = common + ["train.batch_size=2", "train.grad_clip=0", "train.update_in_backward=false"]
    train(load_config(recipe("adamw"), over), out / "adamw-noclip-ddp-normal")
    # A warm start's switch creates the factors on every rank: rank 0's are broadcast. Each rank
    # writes its final weights, which must be the same bits.
    tr = Trainer(load_config(recipe("relora"), common + warm + ["train.batch_size=2"]), out / "relora-warm-ddp")
    tr.fit()
    weights = {k: v.detach().clone() for k, v in tr.acc.unwrap_model(tr.model).state_dict().items()}
    torch.save(weights, out / "relora-warm-ddp" / f"rank{tr.rank}.pt")
    del tr
    for sharding in ("ddp", "fsdp2"):
        for m in methods:
            for tag, clip in clips.items():
                over = common + ["train.batch_size=2", f"train.grad_clip={clip}", f"dist.sharding={sharding}"]
                train(load_config(recipe(m), over), out / f"{m}-{tag}-{sharding}")
    """
)
#: GaLore under FSDP2 with updates in backward, straight and split at step 10 (clipping on, so the
#: saved previous norm matters; refreshes at 11 and 16 after the split).
RESUME_WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    root, out, mode, common = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    recipe = root / "recipes" / "tiny" / "galore.yaml"
    over = common + ["train.batch_size=2", "train.grad_clip=0.05", "dist.sharding=fsdp2",
                     "train.save_every=10", "train.log_every=1"]
    train(load_config(recipe, over), out / "galore-straight")
    train(load_config(recipe, over), out / "galore-split",
          resume=str(out / "galore-straight" / "checkpoints" / "step-10"))
    """
)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("inb-dist")
    clips = ",".join(f"{k}={v}" for k, v in CLIPS.items())
    run_worker_pair(WORKER, out, [",".join(selected(request, "method", METHODS)), clips, *COMMON])
    return out


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("inb-dist-resume")
    run_worker_pair(
        RESUME_WORKER, out, [*COMMON, "train.update_in_backward=true", "train.grad_accum=4"], one=False
    )
    return out


def _norms(run) -> dict[int, float]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_norm"] for r in recs if "grad_norm" in r}


def _low_rank_accumulated(method: str) -> bool:
    """Whether the recipe's optimizer sums projected micro-gradients (low-rank accumulators,
    `ProjectedAdam.accumulation_basis`): one process and DDP do, FSDP2 shards cannot."""
    name = (
        yaml.safe_load((ROOT / "recipes" / "tiny" / f"{method}.yaml").read_text())
        .get("optim", {})
        .get("name", "adamw")
    )
    return bool(getattr(optimizers.method_spec(name).cls, "PROJECTED_GRAD_ONLY", False))


def _cases() -> list:
    """Every (method, clip, mode)."""
    return [
        pytest.param(method, clip, mode, id=f"{method}-{clip}-{mode}")
        for method in METHODS
        for clip in CLIPS
        for mode in MODES
    ]


def _tolerance(method: str, summary: dict) -> float:
    """1e-5 relative in the weights, as the other parity tests. One process sums a micro-batch's 4
    rows in one product where the ranks sum 2 and 2 (and average in another order): differences
    of ~1e-7 in the gradients, which two things amplify. A run whose restarts refactorize (SVD)
    the factors: 2e-4 (2e-7 without restarts, 8e-5 with them, measured). A method whose state is
    kept per block, not per element (`fsdp2_whole_state`; 8-bit blocks round a last-bit
    difference to a whole code step): 1e-3 (adamw_8bit
    measured 1.1e-4 to 2.1e-4; reordering one process's own sum moves it 3.5e-4)."""
    if method in optimizers.METHODS and optimizers.method_spec(method).fsdp2_whole_state:
        return 1e-3
    return 2e-4 if summary.get("opt/restarts") else 1e-5


def _norm_tolerance(method: str) -> float:
    """The logged gradient norms: 1e-5 relative, or 1e-4 for a method whose state is kept per
    block (`fsdp2_whole_state`): its weights differ by up to `_tolerance` (code steps), and the
    next gradients with them (adamw_8bit, its moments restarted from zero by a momentum reset every
    7 steps: 3e-5 at step 10, measured)."""
    if method in optimizers.METHODS and optimizers.method_spec(method).fsdp2_whole_state:
        return 1e-4
    return 1e-5


@pytest.mark.parametrize(("method", "clip", "mode"), _cases())
def test_two_processes_equal_one_process_with_updates_in_backward(method, clip, mode, runs):
    one_dir, two_dir = runs / f"{method}-{clip}-1p", runs / f"{method}-{clip}-{mode}"
    one = json.loads((one_dir / "summary.json").read_text())
    two = json.loads((two_dir / "summary.json").read_text())
    assert two["world_size"] == 2 and two["sharding"] == mode and one["world_size"] == 1
    assert two["tokens"] == one["tokens"]
    # The logged norm is the real one (never 0), the same number in both (the clip coefficient).
    a, b = _norms(one_dir), _norms(two_dir)
    assert len(a) == 4 and a.keys() == b.keys() and min(a.values()) > 0 and min(b.values()) > 0
    if not (clip == "noclip" and mode == "fsdp2" and _low_rank_accumulated(method)):
        # (Without clipping one process keeps GaLore's low-rank accumulators and logs the norm of
        # back(R) + G_K; FSDP2's shards keep full ones and log the whole gradient's: documented.
        # With clipping every accumulator is full, and the norms agree in every mode.)
        tol = _norm_tolerance(method)
        assert all(abs(b[s] - a[s]) <= tol * a[s] for s in a), (b, a)
    if clip == "clip":
        assert min(a.values()) > 2 * float(CLIPS["clip"])  # clipping bites at every logged step
    assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * abs(one["final_val_loss"])
    diff = rel_diff(final(two_dir), final(one_dir))
    print(f"{method} {clip} {mode}: max relative weight difference to one process {diff:.1e}")
    assert diff <= _tolerance(method, one)


@pytest.mark.parametrize("method", [m for m in METHODS if _low_rank_accumulated(m)])
def test_low_rank_accumulation_does_not_change_fsdp2_weights(method, runs):
    """Without clipping, GaLore under FSDP2 (full sharded accumulators) ends where one process
    (low-rank accumulators) does: proj(back(R) + G_K) = R + proj(G_K) up to rounding."""
    one, two = final(runs / f"{method}-noclip-1p"), final(runs / f"{method}-noclip-fsdp2")
    assert rel_diff(two, one) <= 1e-5


def test_ddp_in_backward_is_bitwise_ddp_without_clipping(runs):
    """Each rank sums its micro-batches' gradients in autograd's order, then G/N is summed over
    the ranks: the order DDP's reducer uses, so adamw ends with the same bits as DDP itself.
    Bitwise although DDP reduces buckets and this mode one gradient at a time: with two ranks
    each entry's all-reduce is one commutative addition and x 1/2 is exact, whatever the grouping;
    the logged norms are the same fp64 sum in model order."""
    a, b = final(runs / "adamw-noclip-ddp"), final(runs / "adamw-noclip-ddp-normal")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _norms(runs / "adamw-noclip-ddp") == _norms(runs / "adamw-noclip-ddp-normal")


def test_ddp_in_backward_across_a_warm_start_switch(runs):
    """ReLoRA's warm start under DDP in this mode (no DDP wrapper to re-wrap at the switch): the
    ranks stay bitwise identical through the switch and two merges (each applies the same step to
    the same all-reduced gradients), and equal one process (to a tolerance: another summation)."""
    r0, r1 = (torch.load(runs / "relora-warm-ddp" / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)
    one = json.loads((runs / "relora-warm-1p" / "summary.json").read_text())
    two = json.loads((runs / "relora-warm-ddp" / "summary.json").read_text())
    assert one["opt/restarts"] == two["opt/restarts"] == 2
    assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * abs(one["final_val_loss"])
    a, b = _norms(runs / "relora-warm-1p"), _norms(runs / "relora-warm-ddp")
    assert a.keys() == b.keys() and all(abs(b[s] - a[s]) <= 1e-5 * a[s] for s in a)
    assert rel_diff(final(runs / "relora-warm-ddp"), final(runs / "relora-warm-1p")) <= _tolerance(
        "relora", one
    )


def test_resume_under_two_fsdp2_processes_is_exact_with_updates_in_backward(resume_runs):
    """The split run resumed at step 10 (its first logged step is 11, with the straight run's loss,
    lr and gradient norm there) and ends bitwise equal: the same operations in the same order once
    the state is restored."""
    runs = resume_runs
    assert_resumed_from(runs / "galore-straight", runs / "galore-split", 10)
    a, b = final(runs / "galore-straight"), final(runs / "galore-split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = json.loads((runs / "galore-straight" / "summary.json").read_text())
    sb = json.loads((runs / "galore-split" / "summary.json").read_text())
    assert sa["final_val_loss"] == sb["final_val_loss"]
