"""Continued pretraining on a GPU: a run from `model.init` on CUDA starts from the source model
(its step-0 loss is transformers' fp32 CPU loss of the same model on the same tokens, within
1e-4: another device's kernels, TF32 off), and the FSDP2 loader fills its shards and RoPE's
buffers on the GPU (a forward on CUDA gives the CPU model's loss)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _common import ROOT
from test_continue import SOURCES, hf_loss, over, save_source

from effpretrain.config import load_config
from effpretrain.fsdp import apply_fsdp2
from effpretrain.models.pretrained import load_shards_, meta_model, open_pretrained
from effpretrain.trainer import train


def test_a_run_from_weights_starts_at_the_source_loss_on_cuda(tmp_path):
    shape, _ = SOURCES["qwen2_tied"]
    src = save_source(shape, tmp_path / "src")
    over_cuda = over(src, "train.max_steps=2", "train.device=cuda", "train.tf32=false")
    train(load_config(ROOT / "recipes/tiny/adamw.yaml", over_cuda), tmp_path / "run")
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step0 = next(e["val_loss"] for e in events if e.get("event") == "eval" and e["step"] == 0)
    assert abs(step0 - hf_loss(src)) <= 1e-4, (step0, hf_loss(src))


def test_fsdp2_loader_fills_shards_and_buffers_on_cuda(tmp_path):
    import torch.distributed as dist

    shape, _ = SOURCES["llama_sharded"]
    src: Path = save_source(shape, tmp_path / "src", "150KB")
    weights, config = open_pretrained(str(src))
    config._attn_implementation = "sdpa"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = apply_fsdp2(meta_model(config))
        load_shards_(model, weights, "cuda")
        assert all(b.device.type == "cuda" for b in model.buffers())
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got = float(model(input_ids=ids.cuda(), labels=ids.cuda()).loss)
        from transformers import AutoModelForCausalLM

        ref_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = float(ref_model(input_ids=ids, labels=ids).loss)
        assert abs(got - ref) <= 1e-4 * abs(ref), (got, ref)
    finally:
        dist.destroy_process_group()
