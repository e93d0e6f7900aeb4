"""Claim about `effpretrain.cli.end_process_group`, the end of every command run by several
processes: once it returns, no gloo group (and none of its threads) is left for the interpreter's
exit to destroy. DTensor's process-wide caches hold device meshes after an FSDP2 step, and a mesh
keeps its group alive past `destroy_process_group`; destroyed at exit, the group's threads aborted
a finished rank now and then ("terminate called without an active exception", exit -6). Whether
the abort happens is a race; whether the threads outlive the call is not, so that is what the test
reads (thread names from /proc)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from distributed_helpers import run_worker

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from effpretrain.cli import end_process_group

    def threads():
        return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

    def main():  # locals only: what stays alive is what torch's and our modules keep
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model(torch.randn(2, 8)).sum().backward()
        model[0].weight.redistribute(placements=[Replicate()])  # a redistribution plan cached

    dist.init_process_group("gloo")
    before = [t for t in threads() if "gloo" in t]
    main()
    end_process_group(together=True)
    after = [t for t in threads() if "gloo" in t]
    Path = __import__("pathlib").Path
    Path(sys.argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps({"before": before, "after": after}))
    """
)


@pytest.mark.multiprocess
def test_no_gloo_thread_outlives_the_end_of_an_fsdp2_run(tmp_path: Path) -> None:
    run_worker(WORKER, tmp_path)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["before"], "the group's threads were never seen: the test reads nothing"
        assert seen["after"] == [], f"rank {rank}: {seen['after']} alive after end_process_group"
