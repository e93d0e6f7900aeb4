"""Claims about optimizers/_owners.py, the owner-rank layer for whole-matrix optimizer math under
FSDP2: the placement keeps every rank's state within total/N + the largest single state and does
not depend on the parameters' order; the row split is torch.chunk's (FSDP2's); and, with 2 and 3
CPU processes (gloo; 3 makes ownership uneven), galore, fira, apollo, apollo_mini, galore_8bit
and adamw_8bit on sharded matrices end bitwise equal to one process stepping the whole matrices
on the same gradients, equal to the gather path, with each basis computed once (on its owner),
per-rank state summing to the one-process state, a zero gradient allocating state without
stepping, a resume through torch.distributed.checkpoint exact, and a step costing two
all-to-alls per bucket."""

from __future__ import annotations

import json
import random
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from _common import child_env

from optimizers import assign_owners, shard_rows, whole_cost


@pytest.mark.parametrize("rows", [0, 1, 5, 7, 64, 172, 512])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_rows_is_torch_chunk(rows, world):
    chunks = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
    assert shard_rows(rows, world) == chunks + [0] * (world - len(chunks))


def test_whole_cost_is_mnk_for_a_projected_matrix_and_numel_otherwise():
    assert whole_cost((64, 172), {"rank": 8}) == 64 * 172 * 8
    assert whole_cost((4, 172), {"rank": 8}) == 4 * 172 * 4  # k = min(r, m, n)
    assert whole_cost((64, 172), {"rank": 8, "project": False}) == 64 * 172
    assert whole_cost((64, 172), {}) == whole_cost((11008,), {}) // 11008 * 64 * 172


def _llama_items(layers: int, d: int, f: int, r: int) -> list[tuple[int, int]]:
    """(cost, state bytes) of a LLaMA's projected matrices, GaLore's right/left-side formula (fp32)."""
    items = []
    for _ in range(layers):
        for m, n in [(d, d)] * 4 + [(f, d)] * 2 + [(d, f)]:
            k = min(r, m, n)
            state = 4 * (2 * m * k + k * n) if m >= n else 4 * (2 * k * n + m * k)
            items.append((m * n * k, state))
    return items


@pytest.mark.parametrize("world", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("items", [_llama_items(24, 2048, 5461, 512), _llama_items(2, 64, 172, 8)])
def test_no_rank_holds_more_than_total_over_n_plus_the_largest_state(world, items):
    owners = assign_owners(items, world)
    load = [0] * world
    for (_, state), r in zip(items, owners):
        load[r] += state
    total, largest = sum(s for _, s in items), max(s for _, s in items)
    assert sum(load) == total
    assert max(load) <= total / world + largest
    if len(items) >= 4 * world:
        assert min(load) > 0  # every rank gets work


def test_placement_bound_holds_for_random_items_and_totals_ignore_order():
    rng = random.Random(0)
    for trial in range(200):
        world = rng.randint(1, 9)
        items = [
            (rng.choice([1, 10, 10, 100, 1000]), rng.choice([8, 8, 64, 512]))
            for _ in range(rng.randint(1, 40))
        ]
        owners = assign_owners(items, world)
        load = [0] * world
        for (_, s), r in zip(items, owners):
            load[r] += s
        assert max(load) <= sum(s for _, s in items) / world + max(s for _, s in items), trial
        shuffled = items[:]
        rng.shuffle(shuffled)
        again = [0] * world
        for (_, s), r in zip(shuffled, assign_owners(shuffled, world)):
            again[r] += s
        assert again == load, trial  # the estimator's per-rank figures need no parameter order


def test_placement_balances_compute_on_llama_shapes():
    items = _llama_items(24, 2048, 5461, 512)
    for world in (2, 4, 8):
        cost = [0] * world
        for (c, _), r in zip(items, assign_owners(items, world)):
            cost[r] += c
        assert max(cost) <= 1.1 * sum(cost) / world, (world, cost)


def test_bad_world_is_an_error():
    with pytest.raises(ValueError, match="world"):
        assign_owners([(1, 1)], 0)


# ------------------------------------------------------------------ 2 and 3 processes

METHODS = [
    "galore",
    "fira",
    "apollo",
    "apollo_mini",
    "galore_8bit",
    "adamw_8bit",
    "muon",
    "swan",
    "sinkgd",
    "scale",
]

WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.fsdp import fully_shard
    import optimizers
    from optimizers._owners import COMM
    from optimizers._sharded import local
    from effpretrain.checkpoint import sharded
    from effpretrain.cli import end_process_group

    out, methods = Path(sys.argv[1]), sys.argv[2].split(",")
    dist.init_process_group("gloo")
    def main():  # locals, not globals: nothing holds a mesh (and its gloo group) at exit
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        # LLaMA-tiny-shaped matrices (uneven rows under 3 ranks), an embedding and a norm, and a
        # matrix whose rows are whole 256-entry blocks (8-bit moments step its row shards; under 3
        # ranks 14, 14 and 12 rows, each shard below min_8bit_size 4096, the whole above it).
        MATS = [(64, 64), (64, 64), (172, 64), (172, 64), (64, 172), (7, 40)]
        DENSE = [(512, 64), (40, 256), (64,)]
        STEPS, SAVE = 7, 4  # refreshes (T = 3) at steps 1, 4 and 7; resumed after step 4

        def build(sharded):
            mod = torch.nn.Module()
            gen = torch.Generator().manual_seed(1)
            for i, shape in enumerate(MATS + DENSE):
                mod.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.1))
            if sharded:
                fully_shard(mod)
            return mod

        def groups(name, mod):
            ps = list(mod.parameters())
            mats, dense = ps[: len(MATS)], ps[len(MATS):]
            spec = optimizers.METHODS[name]
            if spec.matrix_params:  # whole-matrix rules; SCALE: the last matrix as its head, p6 its embedding
                head = spec.matrix_role(target=False, embedding=False, ndim=2)
                emb = spec.matrix_role(target=False, embedding=True, ndim=2)
                out = [{"params": mats[:-1] if head else mats, **spec.matrix_group("hidden")}]
                if head:
                    out.append({"params": mats[-1:], **spec.matrix_group(head)})
                if emb:
                    return out + [{"params": dense[:1], **spec.matrix_group(emb)}, {"params": dense[1:]}]
                return out + [{"params": dense}]
            if not spec.projects:
                return [{"params": ps, "min_8bit_size": 256}]
            proj = {"params": mats, **optimizers.METHODS[name].projection_group(rank=8, update_proj_gap=3, scale=0.5)}
            return [proj, {"params": dense}]

        def grads(step):
            gen = torch.Generator().manual_seed(100 + step)
            out = [torch.randn(s, generator=gen) for s in MATS + DENSE]
            if step == 2:
                out[1].zero_()  # a whole zero gradient: state only, no step, no basis
            return out

        def run(name, sharded, steps, whole_matrix="owner", mod=None, opt=None):
            if mod is None:
                mod = build(sharded)
                kw = {"whole_matrix": whole_matrix} if sharded else {}
                opt = optimizers.build_optimizer(name, groups(name, mod), lr=1e-2, **kw)
            for step in steps:
                for p, g in zip(mod.parameters(), grads(step)):
                    p.grad = distribute_tensor(g, p.device_mesh, [Shard(0)]) if sharded else g
                opt.step()
                opt.zero_grad(set_to_none=True)
            return mod, opt

        def whole_weights(mod):
            return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in mod.parameters()]

        report = {}
        for name in methods:
            COMM.reset()
            mod, opt = run(name, True, range(1, STEPS + 1))
            steps_comm = COMM.collectives
            mine = whole_weights(mod)
            gather_mod, _ = run(name, True, range(1, STEPS + 1), whole_matrix="gather")
            gathered = whole_weights(gather_mod)
            # Resume: save after step SAVE with DCP, load into a fresh model and optimizer, finish.
            ck = out / f"{name}-ck"
            ck_mod, ck_opt = run(name, True, range(1, SAVE + 1))
            skeleton = sharded.save_sharded(ck, ck_mod, ck_opt)
            new_mod = build(True)
            new_opt = optimizers.build_optimizer(name, groups(name, new_mod), lr=1e-2)
            sharded.load_sharded(ck, new_mod, new_opt, skeleton)
            run(name, True, range(SAVE + 1, STEPS + 1), mod=new_mod, opt=new_opt)
            resumed = whole_weights(new_mod)
            old_layout = None
            if name == "galore_8bit":  # a checkpoint from before rows of whole blocks stepped by shards
                from optimizers.galore_8bit import BlockwiseMoments8bit
                rule = BlockwiseMoments8bit.__dict__["steps_shards"]
                BlockwiseMoments8bit.steps_shards = classmethod(lambda cls, shape: False)
                old_mod, old_opt = run(name, True, range(1, SAVE + 1))
                old_skeleton = sharded.save_sharded(out / "old-ck", old_mod, old_opt)
                BlockwiseMoments8bit.steps_shards = rule
                new_mod = build(True)
                new_opt = optimizers.build_optimizer(name, groups(name, new_mod), lr=1e-2)
                sharded.load_sharded(out / "old-ck", new_mod, new_opt, old_skeleton)
                run(name, True, range(SAVE + 1, STEPS + 1), mod=new_mod, opt=new_opt)
                old_layout = all(torch.equal(a, b) for a, b in zip(whole_weights(new_mod), mine))
            state = optimizers.measured_state_bytes(opt)
            refreshes = getattr(opt, "refresh_count", 0)
            tallies = [None] * world
            dist.all_gather_object(tallies, {"state": state, "refreshes": refreshes,
                                             "held": sum(1 for s in opt.state.values() if s),
                                             "empty": sum(1 for s in opt.state.values() if not s)})
            if rank == 0:
                ref_mod, ref_opt = run(name, False, range(1, STEPS + 1))
                ref = whole_weights(ref_mod)
                one_state = optimizers.measured_state_bytes(ref_opt)
                spec = optimizers.METHODS[name]
                singles = []
                for g in ref_opt.param_groups:
                    for p in g["params"]:
                        if not spec.steps_shards(tuple(p.shape), g):
                            singles.append(spec.state_bytes(tuple(p.shape), g, p.dtype))
                report[name] = {
                    "whole_step": [not spec.steps_shards(tuple(p.shape), g)
                                   for g in ref_opt.param_groups for p in g["params"]],
                    "shapes": [list(p.shape) for g in ref_opt.param_groups for p in g["params"]],
                    "rel_diff": [float((a - b).norm() / b.norm()) for a, b in zip(mine, ref)],
                    "equal_to_one_process": [torch.equal(a, b) for a, b in zip(mine, ref)],
                    "owner_equals_gather": all(torch.equal(a, b) for a, b in zip(mine, gathered)),
                    "resume_exact": all(torch.equal(a, b) for a, b in zip(resumed, mine)),
                    "old_layout_resume_exact": old_layout,
                    "max_diff": max(float((a - b).abs().max()) for a, b in zip(mine, ref)),
                    "gather_diff": max(float((a - b).abs().max()) for a, b in zip(gathered, ref)),
                    "ranks": tallies,
                    "one_state": one_state,
                    "one_refreshes": getattr(ref_opt, "refresh_count", 0),
                    "largest_single": max(singles),
                    "collectives": steps_comm,
                }
        if rank == 0:
            (out / "report.json").write_text(json.dumps(report))

    main()
    end_process_group(together=True)  # rank 0 alone ran the references; DTensor caches hold the mesh
    """
)


def _run(world: int, out: Path) -> dict:
    worker = out / "worker.py"
    worker.write_text(WORKER)
    env = child_env()
    from distributed_helpers import torchrun

    cmd = [*torchrun(world), str(worker), str(out), ",".join(METHODS)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module", params=[2, 3], ids=["2-processes", "3-processes"])
def report(request, tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    return request.param, _run(request.param, tmp_path_factory.mktemp(f"owners{request.param}"))


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.multiprocess
def test_owner_steps_equal_one_process_bitwise(name, report):
    world, rep = report
    r = rep[name]
    for whole, shape, equal, rel in zip(
        r["whole_step"], r["shapes"], r["equal_to_one_process"], r["rel_diff"]
    ):
        # Bitwise where the same operations run on every entry: a whole step runs on its owner
        # with one process's code on the same gathered gradient; under 2 ranks (one thread each:
        # no parallel split of a loop) every shard starts at a multiple of 32 entries (2 x
        # AVX-512's 16 floats, the widest vector step of torch's CPU loops), and shards of whole
        # 256-entry rows (GaLore-8bit steps them in place) split where the whole tensor's blocks
        # do, so each entry takes the same vector or scalar path as in the whole tensor.
        if whole or world == 2 or (len(shape) == 2 and shape[1] % 256 == 0):
            assert equal, (world, shape, r["rel_diff"])
        else:
            # An element-wise (AdamW) shard of uneven length runs torch's fused kernel with another
            # vector tail than the whole tensor: the last bits may differ (not the owner layer's).
            assert rel <= 1e-6, (world, r["rel_diff"])
    # The same step code on the same gradients, where only the rank running it differs; a resume
    # runs the same kernels in the same order as the straight run: bitwise.
    assert r["owner_equals_gather"]
    assert r["resume_exact"]
    if name == "galore_8bit":  # its (40, 256) matrix was saved whole by its owner, resumed by rows
        assert r["old_layout_resume_exact"]


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.multiprocess
def test_each_rank_holds_its_share_of_the_state_and_bases_are_computed_once(name, report):
    world, rep = report
    r = rep[name]
    states = [t["state"] for t in r["ranks"]]
    # Whole-matrix state is on its owner only, so the ranks' state adds up to one process's
    # (element-wise moments of the dense group are split, which also adds up) ...
    if name != "adamw_8bit":
        assert sum(states) == r["one_state"], states
    else:  # ... except bitsandbytes' shared quantile maps, held once by every rank that has 8-bit state
        assert sum(states) - r["one_state"] == (world - 1) * 2 * 4 * 256, states
    assert max(states) <= r["one_state"] / world + r["largest_single"] + 2 * 4 * 256
    assert all(t["held"] for t in r["ranks"])  # every rank owns something
    assert not any(t["empty"] for t in r["ranks"])  # and has no entry for what others own
    refreshes = [t["refreshes"] for t in r["ranks"]]
    assert sum(refreshes) == r["one_refreshes"], refreshes
    # Buckets: everything fits one bucket here, so a step is two all-to-alls (W and G in, W out).
    assert r["collectives"] == 2 * 7
