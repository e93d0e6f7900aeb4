"""INT8 weights (`train.weight_quant: int8`) and the one writer: an INT8 weight refuses in-place
writes (every update lands through `optimizers.writer.written`, rounded once), every tiny recipe
with INT8 weights holds exactly the weight and state bytes the estimator states, a split run ends
bitwise on the straight run's codes with the resume proven, the streamed export reloads with
transformers and gives `effpretrain eval`'s loss, the embedding and the head can be INT8 too (a
tied one stays one weight), and stochastic rounding keeps the updates that rounding to nearest
loses."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from _common import ROOT, TINY_OVERRIDES, assert_resumed_from

from effpretrain.checkpoint import read_model_state
from effpretrain.config import load_config
from effpretrain.models.quantize import CODES_SUFFIX, SCALE_SUFFIX, quantize_weights_, quantized_weights
from effpretrain.trainer import train
from optimizers import rounding
from optimizers.int8 import Int8Weight
from optimizers.writer import Rounding, attach, written

TINY_RECIPES = sorted((ROOT / "recipes" / "tiny").glob("*.yaml"))
INT8 = ["train.weight_quant=int8", "train.eval_every=0", "train.memory_steps=[]"]


def test_an_int8_weight_refuses_in_place_writes_and_takes_the_writers():
    w = torch.nn.Parameter(Int8Weight.quantize(torch.randn(8, 256), 128), requires_grad=True)
    before = w.dequantize().clone()
    with torch.no_grad():
        for write in (lambda: w.add_(1.0), lambda: w.mul_(0.5), lambda: w.copy_(torch.zeros(8, 256))):
            with pytest.raises(RuntimeError, match="through optimizers.writer.written"):
                write()
        assert torch.equal(w.dequantize(), before)
        with written(w) as value:
            assert value.dtype == torch.float32 and torch.equal(value, before)
            value.add_(1.0)
    # Rounded to nearest (no plan attached): each value moved by 1 within half a code step.
    step = w.scales.repeat_interleave(128, dim=1)
    assert bool(((w.dequantize() - before - 1.0).abs() <= step / 2 + 1e-6).all())


def test_int8_linear_and_embedding_compute_with_the_dequantized_weight():
    """Forward and gradients equal a dense layer holding the dequantized values (same products)."""
    torch.manual_seed(0)
    q = Int8Weight.quantize(torch.randn(16, 256), 128)
    dense = torch.nn.Parameter(q.dequantize().clone())
    qp = torch.nn.Parameter(q, requires_grad=True)
    x = torch.randn(3, 5, 256, requires_grad=True)
    y, y_ref = torch.nn.functional.linear(x, qp), torch.nn.functional.linear(x, dense)
    assert torch.allclose(y, y_ref, atol=1e-5)
    (y * y_ref.detach()).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    (y_ref * y_ref.detach()).sum().backward()
    assert torch.allclose(qp.grad, dense.grad, atol=1e-4) and torch.allclose(gx, x.grad, atol=1e-5)
    ids = torch.tensor([[0, 3, 3], [15, 2, 0]])
    e, e_ref = torch.nn.functional.embedding(ids, qp), torch.nn.functional.embedding(ids, dense)
    assert torch.equal(e, e_ref)  # the same rows, dequantized the same way
    qp.grad = dense.grad = None
    e.sum().backward()
    e_ref.sum().backward()
    assert torch.equal(qp.grad, dense.grad)


def test_the_writer_rounds_once_and_draws_the_same_noise_for_a_shard():
    """Stochastic rounding through the writer is keyed by (seed, parameter, step, offset): the same
    step twice gives the same codes; another step other codes; the expectation of many steps'
    roundings of the same update is the update."""
    torch.manual_seed(1)
    base = Int8Weight.quantize(torch.randn(4, 128), 128)
    plan = Rounding(stochastic=True, seed=3, step=1)

    def write(step: int) -> torch.Tensor:
        p = torch.nn.Parameter(Int8Weight(base.codes.clone(), base.scales.clone(), 128), requires_grad=True)
        attach([(7, p)], plan)
        plan.step = step
        with torch.no_grad(), written(p) as value:
            value.add_(1e-3)
        return p.dequantize()

    a, b, c = write(1), write(1), write(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    mean = torch.stack([write(s) for s in range(1, 400)]).double().mean(0)
    moved = (mean - base.dequantize().double()).mean()
    assert abs(float(moved) - 1e-3) < 2e-4  # 1e-3 is a fraction of a code step here


@pytest.mark.run
@pytest.mark.parametrize("recipe", TINY_RECIPES, ids=lambda p: p.stem)
def test_every_tiny_recipe_with_int8_weights_holds_the_estimated_bytes(recipe, tmp_path):
    """Weights (codes and scales, the rest in fp32) and optimizer state equal the estimate to the
    byte after 3 steps, and the run's loss is finite."""
    over = [*TINY_OVERRIDES, *INT8, "train.max_steps=3"]
    s = train(load_config(recipe, over), tmp_path / "run")
    assert s["estimate_matches_measured"]["weights"], (s["weight_bytes"], s["estimated"]["weights"])
    assert s["estimate_matches_measured"]["optimizer_state"], (
        s["optimizer_state_bytes"],
        s["estimated"]["optimizer_state"],
    )
    assert math.isfinite(s["final_val_loss"])


@pytest.mark.run
@pytest.mark.parametrize("method", ["adamw", "apollo_mini"])
def test_an_int8_split_run_ends_on_the_straight_runs_codes(method, tmp_path):
    """10 steps straight vs 5 + resume (updates in backward for APOLLO-Mini): the resumed run
    starts at step 6 with the straight run's loss and ends on the same codes and scales. Bitwise:
    the same operations in the same order once the state is restored, and the rounding noise is a
    function of the step, not a generator's state."""
    over = [*TINY_OVERRIDES, *INT8, "train.max_steps=10", "train.save_every=5", "train.log_every=1"]
    if method == "apollo_mini":
        over += ["train.update_in_backward=true", "train.grad_clip=0"]
    recipe = ROOT / "recipes" / "tiny" / f"{method}.yaml"
    train(load_config(recipe, over), tmp_path / "straight")
    train(
        load_config(recipe, over),
        tmp_path / "resumed",
        resume=str(tmp_path / "straight" / "checkpoints" / "step-5"),
    )
    assert_resumed_from(tmp_path / "straight", tmp_path / "resumed", 5)
    a = read_model_state(tmp_path / "straight" / "checkpoints" / "step-10")
    b = read_model_state(tmp_path / "resumed" / "checkpoints" / "step-10")
    assert any(k.endswith(CODES_SUFFIX) for k in a) and any(k.endswith(SCALE_SUFFIX) for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.run
def test_the_streamed_export_reloads_and_gives_effpretrains_eval_loss(tmp_path, capsys):
    """The export dequantizes each INT8 weight into an fp32 HF folder; transformers' model on the
    validation rows gives the loss `effpretrain eval` reports for the checkpoint (within 1e-4:
    the same values, with the dequantized products taken in another order)."""
    from transformers import AutoModelForCausalLM

    from effpretrain import cli, data
    from effpretrain.evaluation import evaluate
    from effpretrain.export import export

    over = [*TINY_OVERRIDES, *INT8, "train.max_steps=4", "train.weight_quant_embeddings=true"]
    cfg = load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", over)
    train(cfg, tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / "hf")
    assert cli.main(["eval", str(tmp_path / "run")]) == 0
    reported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not quantized_weights(model)
    corpus = data.load_corpus(cfg.data)
    tok = data.load_tokenizer(cfg.data, corpus)
    val = data.validation_set(corpus, tok, cfg.data.seq_len, cfg.data.mode, cfg.train.eval_tokens)
    got = evaluate(
        model,
        val,
        cfg.train.batch_size,
        rank=0,
        world=1,
        device=torch.device("cpu"),
        autocast=contextlib.nullcontext,
        all_reduce_sum=lambda t: t,
        loss=cfg.train.loss,
        chunk_tokens=cfg.train.loss_chunk_tokens,
    )
    assert abs(got.loss - reported) <= 1e-4 * abs(reported), (got.loss, reported)


def test_a_tied_embedding_stays_one_int8_weight():
    from effpretrain.models.llama import ModelShape, build_model

    shape = ModelShape(hidden=128, intermediate=256, heads=4, layers=1, kv_heads=2, tied=True)
    model = build_model(shape.hf_config(300, 32), seed=0)
    assert quantize_weights_(model, ["q_proj"], 128, embeddings=True) == 2  # embedding and q_proj
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embed.weight, Int8Weight) and head.weight is embed.weight
    sd = model.state_dict()
    assert sd["lm_head." + CODES_SUFFIX] is sd["model.embed_tokens." + CODES_SUFFIX]


def test_rounding_to_nearest_loses_small_int8_updates_that_stochastic_rounding_keeps():
    """Twenty writes of an update a tenth of a code step: to nearest, the codes never move;
    stochastically, the weight moves by about the twenty updates (each kept in expectation)."""
    torch.manual_seed(2)
    base = Int8Weight.quantize(torch.randn(64, 128), 128)
    tenth = 0.1 * base.scales.repeat_interleave(128, dim=1)
    for stochastic in (False, True):
        p = torch.nn.Parameter(Int8Weight(base.codes.clone(), base.scales.clone(), 128), requires_grad=True)
        plan = Rounding(stochastic=stochastic, seed=0)
        attach([(0, p)], plan)
        for step in range(1, 21):
            plan.step = step
            with torch.no_grad(), written(p) as value:
                value.add_(tenth * value.sign())  # away from 0: the group's scale grows with it
        moved = (p.dequantize().abs() - base.dequantize().abs()).mean() / tenth.mean()
        if stochastic:
            assert 15 < float(moved) < 25, float(moved)
        else:
            assert torch.equal(p.codes, base.codes)


def test_int8_bytes_formula():
    assert rounding.int8_nbytes((4096, 4096), 128) == 4096 * 4096 * (1 + 4 / 128)
    w = Int8Weight.quantize(torch.randn(10, 300), 128)
    assert w.nbytes_stored() == rounding.int8_nbytes((10, 300), 128) == 3000 + 4 * 10 * 3


def test_int8_and_compile_are_refused_in_one_line():
    from effpretrain.config import ConfigError

    with pytest.raises(ConfigError, match="does not compose with train.compile"):
        load_config(None, ["train.weight_quant=int8", "train.compile=true"])


INT8_WORKER = """
import json, sys
from pathlib import Path
import torch
from effpretrain.config import load_config
from effpretrain.models.quantize import quantized_weights
from effpretrain.trainer import Trainer, train

root, out, mode, common = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
for m in ("adamw", "apollo_mini"):
    recipe = root / "recipes" / "tiny" / f"{m}.yaml"
    if mode == "one":
        train(load_config(recipe, common + ["train.batch_size=2", "train.grad_accum=2"]), out / f"{m}-1p")
        continue
    for sharding in ("ddp", "fsdp2"):
        tr = Trainer(load_config(recipe, common + ["train.batch_size=2", f"dist.sharding={sharding}"]), out / f"{m}-{sharding}")
        tr.fit()
        codes = {n: (p._local_tensor if hasattr(p, "_local_tensor") else p).codes.clone()
                 for n, p in quantized_weights(tr.launch.unwrap(tr.model))}
        torch.save(codes, out / f"{m}-{sharding}" / f"rank{tr.rank}.pt")
        del tr
"""


@pytest.mark.multiprocess
def test_int8_under_ddp_and_fsdp2_follows_one_process(tmp_path):
    """2-process DDP and FSDP2 with INT8 weights (AdamW; APOLLO-Mini, projected, stepped on owner
    ranks under FSDP2) against one process at the same global batch. DDP's replicas hold the same
    codes (the same averaged gradient, rounded with the same keyed noise), and FSDP2 ends where
    DDP does (within 1e-6: both average two ranks' gradients, one addition each). One process sums
    its two micro-batches in another order, and a last-bit difference in a group's absmax moves its
    scale and can flip a code by a whole step of 1/127 of the group: the runs are held to 1% of the
    loss (measured here: 1.3e-3 after 6 steps)."""
    from distributed_helpers import COMMON, run_worker_pair

    common = [
        *COMMON,
        "train.max_steps=6",
        "train.eval_every=6",
        "train.weight_quant=int8",
        "train.memory_steps=[]",
    ]
    run_worker_pair(INT8_WORKER, tmp_path, common)
    for m in ("adamw", "apollo_mini"):
        one = json.loads((tmp_path / f"{m}-1p" / "summary.json").read_text())
        ddp = json.loads((tmp_path / f"{m}-ddp" / "summary.json").read_text())
        fsdp = json.loads((tmp_path / f"{m}-fsdp2" / "summary.json").read_text())
        assert ddp["estimate_matches_measured"]["weights"] and fsdp["estimate_matches_measured"]["weights"]
        r0, r1 = (torch.load(tmp_path / f"{m}-ddp" / f"rank{r}.pt", weights_only=True) for r in (0, 1))
        assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0), m
        assert abs(fsdp["final_val_loss"] - ddp["final_val_loss"]) <= 1e-6 * ddp["final_val_loss"], m
        assert abs(ddp["final_val_loss"] - one["final_val_loss"]) <= 1e-2 * one["final_val_loss"], m


@pytest.mark.multiprocess
def test_int8_rows_that_do_not_split_evenly_under_fsdp2_are_refused(tmp_path):
    """Three ranks cannot each take equal rows of a 64-row weight: refused in one line, exit 2."""
    import subprocess

    from _common import child_env
    from distributed_helpers import torchrun

    cmd = [*torchrun(3), "-m", "effpretrain", "train", str(ROOT / "recipes" / "tiny" / "adamw.yaml")]
    for o in [*TINY_OVERRIDES, "train.weight_quant=int8", "dist.sharding=fsdp2", "train.max_steps=1"]:
        cmd += ["--set", o]
    res = subprocess.run(
        cmd + ["--out", str(tmp_path / "run")], env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert res.returncode != 0
    assert "which do not split evenly over 3 processes" in res.stderr


@pytest.mark.run
def test_the_trainer_rounds_every_int8_weight_stochastically_at_its_step(tmp_path):
    """Every INT8 weight of a trainer's model carries the run's rounding plan (stochastic for
    `auto`), with its index in the model's parameter order, after `Module.to` and Accelerate's
    preparation (which swap a tensor subclass's contents), and the plan's step is the step taken."""
    from effpretrain.trainer import Trainer
    from optimizers.writer import rounding_of

    cfg = load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", [*TINY_OVERRIDES, *INT8, "train.max_steps=1"])
    tr = Trainer(cfg, tmp_path / "run")
    model = tr.launch.unwrap(tr.model)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    plans = [(rounding_of(p), index[id(p)]) for _, p in quantized_weights(model)]
    assert plans and all(found is not None and found[0].stochastic and found[1] == i for found, i in plans)
    tr.fit()
    assert plans[0][0][0].step == 1


@pytest.mark.parametrize("shape", [(64, 256), (300, 5000), (9000, 200), (5, 7)], ids=str)
@pytest.mark.parametrize("storage", ["int8", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_the_writers_bytes_are_what_it_holds(shape, storage, stochastic):
    """`optimizers.writer.transient_bytes`, which the estimator adds to a rounded weight's step,
    is exactly the peak of what `written` allocates (the project's tensor accounting): rows whole
    groups or padded, one chunk or several, to nearest or stochastically."""
    import importlib

    from optimizers.writer import transient_bytes

    accounting = importlib.import_module("effpretrain.memory.accounting").accounting
    torch.manual_seed(0)
    x = torch.randn(*shape)
    p = torch.nn.Parameter(
        Int8Weight.quantize(x, 128) if storage == "int8" else x.to(torch.bfloat16), requires_grad=True
    )
    attach([(0, p)], Rounding(stochastic, step=1))
    with accounting(p) as log:
        with torch.no_grad(), written(p) as value:
            value.add_(1e-3)
    assert log.replay(include_existing=False)[0] == transient_bytes(shape, storage, stochastic)
