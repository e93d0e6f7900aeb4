"""FSDP2 claims (2 CPU processes, gloo, torchrun, torch's fully_shard): parameters really are
sharded; 2 sharded processes equal one process at the same global batch, with clipping on, for
every method (element-wise optimizers on shards; projection bases and 8-bit blocks from whole
gathered tensors; Stable-SPAM statistics over the whole tensor; refactorization and ReLoRA merges
on whole factors); the per-rank memory estimate is exact; checkpoints are sharded with
torch.distributed.checkpoint, resume under 2 processes is exact, export and eval read them whole
in one process; resuming with another world size or sharding is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from distributed_helpers import COMMON, final, registry_recipes, rel_diff, run_worker_pair

import optimizers

ROOT = Path(__file__).resolve().parent.parent


# (name, recipe, 2-process overrides, 1-process reference overrides): the reference splits its
# global batch into the micro-batches the ranks see, with one thread, as in test_distributed.
#
# Every case clips at the recipe's train.grad_clip (1.0, active here): the trainer's global norm
# sums squares in fp64 (effpretrain/fsdp.py), so one process and FSDP2 get the same fp32 norm
# and clip coefficient, and the projection bases and refactorization SVDs see the same inputs.
CASES = {
    # Accumulation: gradients of the earlier micro-steps stay unsharded (no reduce-scatter).
    "adamw-accum": (
        "adamw",
        ["train.batch_size=1", "train.grad_accum=2"],
        ["train.batch_size=1", "train.grad_accum=4"],
    ),
    # Every registered optimizer and factor kind (from the registries): element-wise methods step
    # their shards, Stable-SPAM reduces its whole-tensor statistics, projection methods and the
    # 8-bit ones step the gathered matrix, factor kinds refactorize / merge whole tensors.
    **{
        m: (
            m,
            ["train.batch_size=2"],
            ["train.batch_size=2", "train.grad_accum=2"],
        )
        for m in registry_recipes()
    },
}
# Resumed under 2 FSDP2 processes: restarts on sharded factors; GaLore-8bit (whole projected
# state and basis, whole 8-bit dense moments); bitsandbytes' AdamW8bit (its own
# nested state dict); Stable-SPAM (sharded moments plus whole scalar statistics).
RESUMES = ["lowrank_restarts", "galore_8bit", "adamw_8bit", "stable_spam"]
RESUME = RESUMES[0]

WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from effpretrain.config import ConfigError, load_config
    from effpretrain.trainer import Trainer, train

    root, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    cases, resume, common = json.loads(sys.argv[4]), sys.argv[5], sys.argv[6:]
    recipe = lambda m: root / "recipes" / "tiny" / f"{m}.yaml"
    if mode == "one":
        for name, (m, _, ref) in cases.items():
            train(load_config(recipe(m), common + ref), out / f"{name}-1p")
        sys.exit(0)
    fsdp = common + ["dist.sharding=fsdp2"]
    for name, (m, two, _) in cases.items():
        cfg = load_config(recipe(m), fsdp + two)
        if name == "adamw":
            # The claim the trainer checks at start-up, seen from outside: local shards only.
            tr = Trainer(cfg, out / "probe")
            shapes = {n: [list(p.shape), list(p.to_local().shape), str(p.placements)]
                      for n, p in tr.model.named_parameters()}
            if tr.rank == 0:
                (out / "shards.json").write_text(json.dumps(shapes))
            del tr
        train(cfg, out / f"{name}-2p")
    over = fsdp + ["train.batch_size=2", "train.save_every=10"]  # with clipping
    for m in resume.split(","):
        train(load_config(recipe(m), over), out / f"{m}-straight")
        train(load_config(recipe(m), over), out / f"{m}-split",
              resume=str(out / f"{m}-straight" / "checkpoints" / "step-10"))
    resume = resume.split(",")[0]
    # The same checkpoint under DDP: refused before any step (every rank raises the same error).
    try:
        ddp = load_config(recipe(resume), common + ["train.batch_size=2", "train.save_every=10"])
        Trainer(ddp, out / "ddp-resume", resume=str(out / f"{resume}-straight" / "checkpoints" / "step-10"))
        msg = "not refused"
    except ConfigError as e:
        msg = str(e)
    (out / "ddp-resume.txt").write_text(msg)
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    run_worker_pair(WORKER, out, [json.dumps(CASES), ",".join(RESUMES), *COMMON])
    return out


def test_parameters_are_really_sharded(runs):
    shapes = json.loads((runs / "shards.json").read_text())
    assert shapes
    for name, (whole, mine, placements) in shapes.items():
        assert "Shard(dim=0)" in placements, name
        assert mine[0] == -(-whole[0] // 2) and mine[1:] == whole[1:], name  # torch.chunk's split


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp2_two_processes_equal_one_process_at_same_global_batch(name, runs):
    one = json.loads((runs / f"{name}-1p" / "summary.json").read_text())
    two = json.loads((runs / f"{name}-2p" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["sharding"] == "fsdp2" and one["world_size"] == 1
    assert two["tokens"] == one["tokens"]
    assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * abs(one["final_val_loss"])
    assert rel_diff(final(runs / f"{name}-2p"), final(runs / f"{name}-1p")) <= 1e-5
    # Per-rank memory: a rank holds half of the gradients and of the sharded optimizer state; the
    # projected (low-rank) state of galore/fira/apollo is replicated, the rest is sharded, except
    # the 8-bit methods', which is whole on every rank. The estimator predicts it exactly.
    assert two["grad_bytes"] < 0.6 * one["grad_bytes"]
    spec = optimizers.METHODS[two["optimizer"]]
    if spec.fsdp2_whole_state:
        assert two["optimizer_state_bytes"] == one["optimizer_state_bytes"]
    else:
        projected = spec.projects
        assert two["optimizer_state_bytes"] < (0.8 if projected else 0.6) * one["optimizer_state_bytes"]
    assert two["optimizer_state_bytes"] == two["estimated"]["optimizer_state"], "per-rank estimate"


def test_global_norm_clipping_over_shards(runs):
    """The clipped adamw runs log the same global gradient norm (> the clip 1.0, so it clips)."""

    def norms(run):
        recs = [json.loads(x) for x in (runs / run / "metrics.jsonl").read_text().splitlines()]
        return [r["grad_norm"] for r in recs if "grad_norm" in r]

    one, two = norms("adamw-1p"), norms("adamw-2p")
    assert len(one) == len(two) == 4 and max(two) > 1.0
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(two, one))


def test_refactorization_ran_on_sharded_factors(runs):
    two = json.loads((runs / "lowrank_restarts-2p" / "summary.json").read_text())
    assert two["opt/restarts"] == 2  # restarts.every=7 over 20 steps


@pytest.mark.parametrize("name", RESUMES)
def test_resume_under_two_fsdp2_processes_is_exact(name, runs):
    a, b = final(runs / f"{name}-straight"), final(runs / f"{name}-split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = json.loads((runs / f"{name}-straight" / "summary.json").read_text())
    sb = json.loads((runs / f"{name}-split" / "summary.json").read_text())
    assert sa["final_val_loss"] == sb["final_val_loss"]


def test_fsdp2_checkpoints_are_sharded_with_dcp(runs):
    """Each rank wrote its own shard file (torch.distributed.checkpoint); no whole-model file."""
    ckpt = runs / f"{RESUME}-straight" / "checkpoints" / "step-20"
    files = sorted(p.name for p in (ckpt / "dcp").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    assert not (ckpt / "model.safetensors").exists() and not (ckpt / "optimizer.pt").exists()
    assert (ckpt / "COMPLETE").is_file() and not list(ckpt.parent.glob("*.tmp-*"))
    sizes = [(ckpt / "dcp" / f).stat().st_size for f in files[1:]]
    assert min(sizes) > 0.3 * max(sizes)  # both ranks hold a real share, not one rank everything


def test_export_of_an_fsdp2_checkpoint_equals_the_one_process_model(runs, tmp_path):
    from safetensors.torch import load_file

    from effpretrain.export import export

    out = export(runs / "adamw-2p", tmp_path / "hf")
    exported = load_file(str(out / "model.safetensors"))
    one = final(runs / "adamw-1p")
    assert exported.keys() <= one.keys() and len(exported) > 10
    assert all(torch.equal(exported[k], one[k]) for k in exported)


def test_resume_with_another_world_size_is_refused(runs, tmp_path):
    ckpt = runs / f"{RESUME}-straight" / "checkpoints" / "step-10"
    args = [*COMMON, "dist.sharding=fsdp2", "train.batch_size=2", "train.save_every=10"]
    cmd = [sys.executable, "-m", "effpretrain", "train", str(ROOT / "recipes" / "tiny" / f"{RESUME}.yaml")]
    for a in args:
        cmd += ["--set", a]
    cmd += ["--out", str(tmp_path / "run"), "--resume", str(ckpt)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in ("WORLD_SIZE", "MASTER_ADDR", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "written by 2 processes" in res.stderr


def test_resume_with_another_sharding_is_refused(runs):
    assert "written with dist.sharding=fsdp2, this run uses ddp" in (runs / "ddp-resume.txt").read_text()


def test_eval_of_an_fsdp2_checkpoint_in_one_process(runs, capsys):
    """`effpretrain eval` reads the sharded checkpoint whole; same weights, same rows (the
    validation set does not depend on the process count), same batch size -> same loss as the
    one-process run's checkpoint."""
    from effpretrain.cli import main

    results = []
    for run in ("adamw-2p", "adamw-1p"):
        assert main(["eval", str(runs / run / "checkpoints" / "step-20")]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0]["step"] == results[1]["step"] == 20
    assert results[0]["val_loss"] == results[1]["val_loss"]


def test_every_method_has_an_fsdp2_parity_case():
    """All registered optimizers and factorized kinds run under FSDP2 and are checked above: the
    tiny recipe each registry row names really trains that optimizer or kind."""
    import yaml

    covered = {(c[0]) for c in CASES.values()}
    recipes = {m: yaml.safe_load((ROOT / "recipes" / "tiny" / f"{m}.yaml").read_text()) for m in covered}
    names = {r.get("optim", {}).get("name", "adamw") for r in recipes.values()}
    kinds = {r.get("factor", {}).get("kind", "none") for r in recipes.values()}
    assert set(optimizers.METHODS) <= names, set(optimizers.METHODS) - names
    from effpretrain.models.factorized import FACTOR_KINDS

    assert {"none", *FACTOR_KINDS} <= kinds, {"none", *FACTOR_KINDS} - kinds
