"""Whole-matrix optimizer math under FSDP2: the owner-rank path beside the gather path, per rank.

For N = 1, 2 and 4 CPU processes (gloo, one thread each), the parameters of llama_20m (its
embedding, 4 decoder layers and head, fp32) are sharded with torch's ``fully_shard`` and a method
steps them on fixed random gradients, once with ``whole_matrix="gather"`` (every rank all-gathers
every whole-matrix weight and gradient, repeats the step and holds all of that state) and once
with ``whole_matrix="owner"`` (optimizers/_owners.py: each matrix steps once, on its owner rank,
which alone holds its state). Per path and N it reports, per rank:

- optimizer-state bytes (`optimizers.measured_state_bytes`) and, for the owner path, the
  estimator's figure for every rank (`effpretrain.memory.estimate`, ``optimizer_state_per_rank``);
- bytes received per step through the optimizer's whole-matrix collectives (the gather path's
  all-gathers and the owner path's all-to-alls, counted by `optimizers._sharded.COMM`; FSDP2's
  own reduce-scatter and the one small all-reduce of the zero-gradient check are the same in
  both paths and not counted) and the number of those collectives per step;
- bases computed per refresh (``refresh_count`` over the refresh steps);
- step time (median over the steps; the slowest rank).

With N processes on fewer cores than N the ranks share cores, so a step's wall time compares the
two paths at the same N, not across N. Writes ``benchmarks/results/fsdp2_optimizer.json``
(commit, machine, torch, date, rows) and prints the table; progress goes to stderr.

    python benchmarks/fsdp2_optimizer.py [--methods galore adamw_8bit] [--worlds 1 2 4] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _bench import log, provenance

ROOT = Path(__file__).resolve().parent.parent
PRESET = "llama_20m"
VOCAB = 32000
RANK = 64
GAP = 2  # refreshes at steps 1, 3, ...


def _groups(name: str, params: list[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
    """The trainer's split: attention/MLP weights projected (for a projecting method), the rest plain."""
    import optimizers
    from effpretrain.config import ATTN_MLP_TARGETS

    spec = optimizers.METHODS[name]
    if not spec.projects:
        return [{"params": [p for _, p in params]}]
    targets = tuple(f"{t}.weight" for t in ATTN_MLP_TARGETS)
    proj = [p for n, p in params if n.endswith(targets)]
    rest = [p for n, p in params if not n.endswith(targets)]
    return [
        {"params": proj, **spec.projection_group(rank=RANK, update_proj_gap=GAP, scale=0.25)},
        {"params": rest},
    ]


def _worker(rank: int, world: int, port: int, methods: list[str], steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from effpretrain.cli import end_process_group

    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for name in methods:
        for path in ("gather", "owner"):
            mine = _measure(name, path, steps)
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine)
            if rank == 0:
                rows.append(
                    {
                        "method": name,
                        "path": path,
                        "world": world,
                        "state_per_rank": [r["state"] for r in every],
                        "estimated_state_per_rank": _estimate(name, world, path),
                        "received_per_step_per_rank": [r["received_per_step"] for r in every],
                        "collectives_per_step": every[0]["collectives_per_step"],
                        "bases_per_refresh_per_rank": [r["bases_per_refresh"] for r in every],
                        "step_s_median": mine["step_s_median"],
                    }
                )
                log(f"  {name} {path} N={world}: {json.dumps(rows[-1])}")
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    end_process_group(together=True)  # rank 0 wrote the rows alone; DTensor caches hold the mesh


def _measure(name: str, path: str, steps: int) -> dict[str, Any]:
    """One method's `steps` optimizer steps on FSDP2-sharded llama shapes along `path`: this
    rank's state bytes, bytes received and collectives per step, bases per refresh, and the
    slowest rank's median step time."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import optimizers
    from effpretrain.memory import model_param_shapes
    from optimizers._sharded import COMM

    shapes = model_param_shapes(PRESET, VOCAB)
    mod = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    for i, s in enumerate(shapes):
        mod.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(s.shape, generator=gen) * 0.02))
    fully_shard(mod)
    named = [(s.name, p) for s, p in zip(shapes, mod.parameters())]
    opt = optimizers.build_optimizer(name, _groups(name, named), lr=1e-3, whole_matrix=path)
    times, received, collectives = [], [], []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(100 + step)
        for s, (_, p) in zip(shapes, named):
            p.grad = distribute_tensor(torch.randn(s.shape, generator=g), p.device_mesh, [Shard(0)])
        COMM.reset()
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        elapsed = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
        received.append(COMM.bytes_received)
        collectives.append(COMM.collectives)
        opt.zero_grad(set_to_none=True)
    refreshes = len(range(1, steps + 1, GAP)) if optimizers.METHODS[name].projects else 0
    return {
        "state": optimizers.measured_state_bytes(opt),
        "received_per_step": statistics.mean(received),
        "collectives_per_step": statistics.mean(collectives),
        "bases_per_refresh": getattr(opt, "refresh_count", 0) / refreshes if refreshes else None,
        "step_s_median": statistics.median(times),
    }


def _estimate(name: str, world: int, path: str) -> list[int] | None:
    """Every rank's optimizer state as `effpretrain.memory.estimate` predicts it (the owner
    placement; the estimator does not model the gather path: None)."""
    from effpretrain.config import OptimConfig
    from effpretrain.memory import estimate

    if path == "gather" and world > 1:
        return None
    cfg = OptimConfig(name=name, rank=RANK, update_proj_gap=GAP, scale=0.25)
    est = estimate(
        PRESET, name, dtype="fp32", vocab_size=VOCAB, optim_cfg=cfg, world_size=world,
        sharding="fsdp2" if world > 1 else "none",
    )  # fmt: skip
    return est.detail["optimizer_state_per_rank"]


def run_world(world: int, methods: list[str], steps: int, tmp: Path) -> list[dict[str, Any]]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"rows-{world}.json"
    mp.spawn(_worker, args=(world, port, methods, steps, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


def format_table(rows: list[dict[str, Any]]) -> str:
    def mb(x: float) -> str:
        return f"{x / 2**20:.2f}"

    lines = [
        "| method | N | path | state MiB per rank (max) | received MiB per rank per step (max) | collectives per step "
        "| bases per refresh per rank | step s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bases = r["bases_per_refresh_per_rank"]
        lines.append(
            f"| {r['method']} | {r['world']} | {r['path']} | {mb(max(r['state_per_rank']))} "
            f"| {mb(max(r['received_per_step_per_rank']))} | {r['collectives_per_step']:g} "
            f"| {'-' if bases[0] is None else ' / '.join(f'{b:g}' for b in bases)} | {r['step_s_median']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["galore", "apollo", "adamw_8bit"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fsdp2_optimizer.json")
    args = ap.parse_args(argv)
    import optimizers

    unknown = [m for m in args.methods if m not in optimizers.METHODS]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(sorted(optimizers.METHODS))}")
    elementwise = [m for m in args.methods if not optimizers.METHODS[m].whole_matrix_steps]
    if elementwise:
        ap.error(
            f"{', '.join(elementwise)} step(s) element-wise on shards (no whole-matrix path to compare); "
            "pick methods that project or keep whole-matrix state"
        )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            log(f"N = {world}")
            rows += run_world(world, args.methods, args.steps, Path(tmp))
    mismatched = [
        f"{r['method']}/{r['path']}/N={r['world']}"
        for r in rows
        if r["estimated_state_per_rank"] is not None and r["state_per_rank"] != r["estimated_state_per_rank"]
    ]
    result = {
        **provenance(),
        "preset": PRESET,
        "rank": RANK,
        "steps": args.steps,
        "update_proj_gap": GAP,
        "rows": rows,
        "state_estimate_mismatches": mismatched,
    }
    print(format_table(rows))
    print(
        f"per-rank state equal to the estimate: {'all' if not mismatched else 'NOT ' + ', '.join(mismatched)}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
