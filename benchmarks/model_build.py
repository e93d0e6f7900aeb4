"""Building a preset's model: wall time, the tensor bytes held at the peak, the process's peak RSS.

The layer-by-layer build is `effpretrain.models.build_model` with an ``after_layer`` that casts
each unit to ``--dtype`` once it is initialised (what the trainer does for a dense bf16-pure run);
``--whole`` is the build before it: the whole model in fp32, then cast. Tensor bytes are the
project's tensor accounting (`effpretrain.memory.accounting`: every storage allocated during the
build, the peak of their live total); RSS is the process's peak resident set (the Python and torch
runtime included). A tiny build runs first, untimed, for the imports a first build makes. The
model's final bytes and its largest unit in fp32 are reported beside them:
the layer-by-layer build holds at most the sum of the two.

A watchdog ends the process (exit code 3, nothing written) when its RSS passes ``--max-rss-gb`` or
the machine has less than ``--reserve-gb`` available, so a build too large for a shared machine
stops before it crowds the other processes out.

    python benchmarks/model_build.py --model llama_7b --dtype bf16 [--whole] [--max-rss-gb 16]
        [--out benchmarks/results/model_build.json]

With ``--out`` the row is added to the file (a row of the same model, dtype and path replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
from _bench import log, provenance, write_result

from effpretrain.memory.accounting import accounting, peak_memory_bytes, tensor_bytes
from effpretrain.models.llama import PRESETS, build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rss_bytes() -> int:
    """The process's resident set now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_bytes() -> int:
    """The machine's MemAvailable (Linux): what can still be allocated without swapping or the OOM
    killer."""
    with open("/proc/meminfo") as f:
        line = next(x for x in f if x.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


def watchdog(limit: float, reserve: float) -> None:
    """Ends the process when its RSS passes `limit` bytes, or when the machine has less than
    `reserve` bytes available (the other processes on it keep their memory)."""

    def watch() -> None:
        while True:
            if rss_bytes() > limit or available_bytes() < reserve:
                log(f"RSS {rss_bytes() / 1e9:.1f} GB, available {available_bytes() / 1e9:.1f} GB: stopped")
                os._exit(3)
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()


def build(model: str, dtype: torch.dtype, whole: bool) -> dict:
    """Builds `model` (seed 0) and returns its figures."""
    units: list[int] = []
    t0 = time.perf_counter()

    def cast(unit: str, module: torch.nn.Module) -> None:
        units.append(tensor_bytes(module.parameters()))  # in fp32, as initialised
        module.to(dtype)
        log(f"  {unit} ready, {time.perf_counter() - t0:.1f} s")

    build_model("tiny", 512, 32, layerwise=not whole)  # the imports a first build makes, untimed
    rss_start = rss_bytes()
    t0 = time.perf_counter()
    with accounting() as reg:
        if whole:
            net = build_model(model, seed=0, layerwise=False).to(dtype)
        else:
            net = build_model(model, seed=0, after_layer=cast)
    wall = time.perf_counter() - t0
    peak = reg.replay(include_existing=False)[0]
    final = tensor_bytes([*net.parameters(), *net.buffers()])
    largest = max(4 * sum(p.numel() for p in m.parameters()) for m in [*net.model.layers, net.lm_head])
    return {
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "path": "whole" if whole else "layer_by_layer",
        "params": sum(p.numel() for p in net.parameters()),
        "final_bytes": final,
        "largest_unit_fp32_bytes": largest,
        "measured_peak_bytes": peak,
        "peak_over_final_bytes": peak - final,
        "rss_before_build_bytes": rss_start,
        "peak_rss_bytes": peak_memory_bytes(torch.device("cpu")),
        "wall_s": round(wall, 1),
        "threads": torch.get_num_threads(),
        # glibc returns freed blocks above this size to the OS at once; unset, freed fp32 layers
        # can stay in the heap and count in the RSS
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--whole", action="store_true", help="build whole in fp32, then cast (the old path)")
    ap.add_argument("--max-rss-gb", type=float, default=16.0)
    ap.add_argument("--reserve-gb", type=float, default=1.5, help="stop when the machine has less available")
    ap.add_argument("--out", type=Path, help="JSON file the row is added to")
    args = ap.parse_args(argv)
    watchdog(args.max_rss_gb * 1e9, args.reserve_gb * 1e9)
    row = {**provenance(), "command": " ".join(["python benchmarks/model_build.py", *sys.argv[1:]])}
    row.update(build(args.model, DTYPES[args.dtype], args.whole))
    print(json.dumps(row, indent=1))
    if args.out:
        rows = json.loads(args.out.read_text())["rows"] if args.out.is_file() else []
        key = ("model", "dtype", "path")
        rows = [r for r in rows if tuple(r[k] for k in key) != tuple(row[k] for k in key)] + [row]
        write_result(args.out, {"benchmark": "benchmarks/model_build.py", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
