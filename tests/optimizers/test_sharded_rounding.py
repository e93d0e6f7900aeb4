"""bf16 weights with stochastic rounding under FSDP2 round as one process does: every method's
update of a shard lands through the writer as its parameter's (its noise index, its rows' offset
in the whole tensor), whichever way the method reaches the shard (the placement driver hands a
rule the local shard; AdamW steps the DTensor itself).

Bitwise: the gradients are given (no reduction), each element's update is the same operations on
the same values in one process and in a shard, and the rounding noise is keyed by the element's
offset in the whole tensor; a weight that steps whole (a projected or orthogonalised matrix) steps
on its owner rank on the same whole values."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from _common import child_env

METHODS = ["adamw", "galore", "spam", "stable_spam", "adam_mini", "muon"]

WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.fsdp import fully_shard
    import optimizers
    from optimizers import writer
    from effpretrain.cli import end_process_group

    out, methods = Path(sys.argv[1]), sys.argv[2].split(",")
    dist.init_process_group("gloo")

    def main():
        SHAPES = [(64, 64), (172, 64), (512, 64), (64,)]  # two matrices, an embedding, a norm

        def build(sharded):
            mod = torch.nn.Module()
            gen = torch.Generator().manual_seed(1)
            for i, shape in enumerate(SHAPES):
                w = (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16)
                mod.register_parameter(f"p{i}", torch.nn.Parameter(w))
            if sharded:
                fully_shard(mod)
            return mod

        def groups(name, mod):
            ps = list(mod.parameters())
            spec = optimizers.METHODS[name]
            if spec.matrix_params:
                return [{"params": ps[:2], **spec.matrix_group("hidden")}, {"params": ps[2:]}]
            if spec.projects:
                proj = spec.projection_group(rank=8, update_proj_gap=3, scale=0.5)
                return [{"params": ps[:2], **proj}, {"params": ps[2:]}]
            return [{"params": ps}]

        def run(name, sharded):
            mod = build(sharded)
            plan = writer.Rounding(stochastic=True, seed=5)
            writer.attach(list(enumerate(mod.parameters())), plan)
            opt = optimizers.build_optimizer(name, groups(name, mod), lr=1e-2)
            for step in range(1, 5):
                gen = torch.Generator().manual_seed(100 + step)
                for p, s in zip(mod.parameters(), SHAPES):
                    g = torch.randn(s, generator=gen).to(torch.bfloat16)
                    p.grad = distribute_tensor(g, p.device_mesh, [Shard(0)]) if sharded else g
                plan.step = step
                opt.step()
                opt.zero_grad(set_to_none=True)
            return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in mod.parameters()]

        report = {}
        for name in methods:
            mine = run(name, True)
            if dist.get_rank() == 0:
                ref = run(name, False)
                report[name] = [bool(torch.equal(a, b)) for a, b in zip(mine, ref)]
        if dist.get_rank() == 0:
            (out / "report.json").write_text(json.dumps(report))

    main()
    end_process_group(together=True)
    """
)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    from distributed_helpers import torchrun

    out: Path = tmp_path_factory.mktemp("sharded_rounding")
    (out / "worker.py").write_text(WORKER)
    cmd = [*torchrun(2), str(out / "worker.py"), str(out), ",".join(METHODS)]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "report.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", METHODS)
def test_fsdp2_shards_round_stochastically_as_one_process(report, name):
    assert report[name] == [True] * 4, report[name]
