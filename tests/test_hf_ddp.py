"""effpretrain.hf with updates in backward under 2 CPU processes (torchrun, gloo): the HF Trainer
with ``create_optimizer(..., update_in_backward=True)``, `EffPretrainCallback` and
`prepare_trainer`, gradient accumulation 2 and per-device batch 4, ends within 1e-5 (relative, the
largest over tensors of ||a - b|| / ||b||) of one process with batch 4 and accumulation 4, which
sees the ranks' micro-batches one after the other (sequential sampling: rank r's micro-batch k of
update s is batch 4 s + 2 k + r, checked from what each rank's collator received), for adamw
(``max_grad_norm=1``: the previous-norm clipping bites) and galore (``max_grad_norm=0``: low-rank
accumulators between basis refreshes). The ranks end bitwise equal; the model is not wrapped in
DDP (no reducer, no buckets) and each rank's estimate is one process's; the logged gradient norms
agree with one process. Without `prepare_trainer` two processes are refused, and a model whose
graph differs between the ranks is caught after the first update (`check_same_order`).

The relative weight differences are printed (``pytest -rP`` or ``-s`` shows them).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from distributed_helpers import rel_diff, run_worker_pair

pytestmark = pytest.mark.multiprocess

CASES = {"adamw": 1.0, "galore": 0.0}  # method: max_grad_norm
STEPS, BATCH, RANKS = 6, 4, 2

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    root, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    cases = dict(c.split("=") for c in sys.argv[4].split(","))
    steps, batch = int(sys.argv[5]), int(sys.argv[6])
    sys.path.insert(0, str(root / "tests"))

    import torch
    from transformers import Trainer, TrainingArguments, default_data_collator
    from test_hf import _inb_case, rows
    from effpretrain import hf
    from effpretrain.errors import ConfigError

    two = mode == "two"
    ga = 2 if two else 4  # one process: the two ranks' micro-batches one after the other


    def trainer_for(tag, model, opt, clip, data, collate=default_data_collator):
        args = TrainingArguments(
            output_dir=str(out / f"{mode}-{tag}"), use_cpu=True, report_to=[], max_steps=steps,
            per_device_train_batch_size=batch, gradient_accumulation_steps=ga, logging_steps=1,
            disable_tqdm=True, save_strategy="no", seed=0, data_seed=0,
            train_sampling_strategy="sequential", max_grad_norm=clip, lr_scheduler_type="linear",
        )
        return Trainer(model=model, args=args, train_dataset=data, optimizers=opt,
                       data_collator=collate, callbacks=[hf.EffPretrainCallback()])


    rank = int(os.environ.get("RANK", "0"))  # the process group starts with the first TrainingArguments
    report = {}
    for case, clip in cases.items():
        model, opt = _inb_case(case, steps, True)
        seen = []

        def collate(feats):
            seen.append([int(f["input_ids"][0]) for f in feats])  # each row's first token
            return default_data_collator(feats)

        tr = trainer_for(case, model, opt, float(clip), rows(), collate)
        hf.prepare_trainer(tr)
        tr.train()
        cb = next(c for c in tr.callback_handler.callbacks if isinstance(c, hf.EffPretrainCallback))
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{mode}-{rank}-{case}.pt")
        report[case] = {
            "wrapped": type(tr.model_wrapped).__name__,
            "unwrapped": tr.model_wrapped is tr.model,
            "ddp_in_accelerator": any(
                isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in tr.accelerator._models
            ),
            "seen": seen,
            "grad_norm": {h["step"]: h["grad_norm"] for h in tr.state.log_history if "loss" in h},
            "est_total": cb.estimate.total,
            "est_peak": cb.estimate.peak,
            "est_peak_terms": cb.estimate.detail["peak_terms"],
        }

    if two:
        # Refused: two processes without prepare_trainer (the Trainer wraps the model in DDP).
        model, opt = _inb_case("adamw", steps, True)
        try:
            trainer_for("unprepared", model, opt, 0.0, rows()).train()
            report["unprepared"] = "trained"
        except ConfigError as e:
            report["unprepared"] = str(e)

        # Caught: a graph that differs between the ranks (same shapes, so the all-reduces pair
        # the wrong gradients without failing).
        class Swapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

            def forward(self, x):
                first, second = (self.a, self.b) if rank == 0 else (self.b, self.a)
                return {"loss": second(first(x)).pow(2).mean()}

        model = Swapped()
        opt = hf.create_optimizer(model, "adamw", num_training_steps=steps, lr=1e-2, update_in_backward=True)
        data = [{"x": torch.randn(8, generator=torch.Generator().manual_seed(i))} for i in range(64)]
        tr = trainer_for("swapped", model, opt, 0.0, data)
        hf.prepare_trainer(tr)
        try:
            tr.train()
            report["swapped"] = "trained"
        except RuntimeError as e:
            report["swapped"] = str(e)

    (out / f"{mode}-{rank}.json").write_text(json.dumps(report))
    if torch.distributed.is_initialized():  # before exit, as torch asks (gloo's threads)
        torch.distributed.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_ddp")
    tail = [",".join(f"{m}={c}" for m, c in CASES.items()), str(STEPS), str(BATCH)]
    run_worker_pair(WORKER, out, tail, nproc=RANKS)
    reports = {name: json.loads((out / f"{name}.json").read_text()) for name in ("one-0", "two-0", "two-1")}
    return out, reports


def _weights(out, name: str, case: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}-{case}.pt", weights_only=True)


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_equal_one_with_the_same_micro_batches(runs, case):
    out, reports = runs
    one, ranks = reports["one-0"][case], [reports[f"two-{r}"][case] for r in range(RANKS)]
    # Sequential sampling: one process's micro-batch 2 k + r of each update is rank r's micro-batch k.
    first = one["seen"][: STEPS * 4]
    for r, rep in enumerate(ranks):
        assert rep["seen"][: STEPS * 2] == [first[4 * s + 2 * k + r] for s in range(STEPS) for k in range(2)]
    a, b = _weights(out, "two-0", case), _weights(out, "one-0", case)
    diff = rel_diff(a, b)
    print(f"{case}: 2 processes vs 1, relative weight difference {diff:.3e}")
    assert diff < 1e-5
    # Replicas bitwise: every rank applies the same step to the same all-reduced gradients.
    assert all(torch.equal(a[k], v) for k, v in _weights(out, "two-1", case).items())
    assert ranks[0]["grad_norm"] == ranks[1]["grad_norm"]  # the same number on every rank
    one_norms = one["grad_norm"]
    assert sorted(one_norms) == [str(s) for s in range(1, STEPS + 1)]
    # GaLore's low-rank accumulators log ||back(R) + G_K|| between refreshes (steps 1 and 4 refresh),
    # which depends on how the micro-batches are split.
    same = ["1", "4"] if case == "galore" else list(one_norms)
    assert [ranks[0]["grad_norm"][s] for s in same] == pytest.approx([one_norms[s] for s in same], rel=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_no_ddp_wrapper_and_each_ranks_estimate_is_one_process(runs, case):
    _, reports = runs
    for r in range(RANKS):
        rep = reports[f"two-{r}"][case]
        assert rep["unwrapped"] and rep["wrapped"] == "LlamaForCausalLM", rep["wrapped"]
        assert not rep["ddp_in_accelerator"]  # no reducer, no buckets
        assert rep["est_peak_terms"].get("ddp_buckets", 0) == 0
        one = reports["one-0"][case]
        assert (rep["est_total"], rep["est_peak"]) == (one["est_total"], one["est_peak"])


def test_two_processes_refuse_an_unprepared_trainer_and_catch_differing_graphs(runs):
    _, reports = runs
    for r in range(RANKS):
        rep = reports[f"two-{r}"]
        assert "2 processes: call effpretrain.hf.prepare_trainer(trainer)" in rep["unprepared"]
        assert "different orders" in rep["swapped"], rep["swapped"]
