"""`effpretrain export RUN_DIR --out DIR`: a plain HuggingFace folder from a run's checkpoint.

Factorized layers (Low-Rank, LoRA, ReLoRA, SLTrain) are merged into dense weights, so the folder
loads with `AutoModelForCausalLM.from_pretrained(DIR)` and gives the trained model's outputs. A kind
with no dense equivalent (`FactorSpec.dense_equivalent` False: CoLA, y = B sigma(A x)) is exported
with its factors: the folder's model type is `effpretrain.models.factored_hf`'s, which loads it
after ``import effpretrain.models.factored_hf`` (see that module for the format). The built-in
tokenizer, when the run used it, is saved beside the model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from effpretrain import data
from effpretrain.checkpoint import load_checkpoint, load_model_weights, read_model_state, resolve_checkpoint
from effpretrain.config import from_dict, validate
from effpretrain.errors import ConfigError
from effpretrain.models import factor_spec, merge_factorized_
from effpretrain.models.quantize import CODES_SUFFIX, SCALE_SUFFIX
from effpretrain.run_model import build_hf_config, build_run_model
from optimizers.rounding import dequantize_int8

log = logging.getLogger("effpretrain")


def export(run_or_ckpt: str | Path, out: str | Path) -> Path:
    """Writes the merged model of the newest complete checkpoint of a run (or of one checkpoint)."""

    path = resolve_checkpoint(run_or_ckpt, "export")
    if not (path / "dcp").is_dir() and (path / "model.safetensors").is_file():
        cfg = validate(from_dict(_trainer_state(path)["config"], str(path)), str(path))
        if cfg.train.weight_quant == "int8":
            return _export_streaming(path, cfg, Path(out))
    state = load_checkpoint(path)
    cfg = validate(from_dict(state["trainer"]["config"], str(path)), str(path))
    weights = read_model_state(path, state)  # whole, also from an FSDP2 run's sharded dcp/
    if "model.embed_tokens.weight" not in weights:
        raise ConfigError(f"export: checkpoint {path} holds no model.embed_tokens.weight")
    model, _ = build_run_model(cfg, weights["model.embed_tokens.weight"].shape[0])
    load_model_weights(model, weights, path)
    spec = factor_spec(cfg.factor.kind) if cfg.factor.kind != "none" else None
    if spec is not None and not spec.dense_equivalent:
        if type(model).__name__ != "LlamaForCausalLM":
            raise ConfigError(
                f"export: factor.kind={cfg.factor.kind} keeps its factors in a FactoredLlamaForCausalLM, "
                f"which builds LlamaForCausalLM models only (this run trained a {type(model).__name__})"
            )
        model = _factored_model(model.to(torch.float32), cfg)
        layers = f"{cfg.factor.kind} factors kept: no dense weight"
    else:
        layers = f"{merge_factorized_(model)} factorized layers merged"
    model = model.to(torch.float32)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"export: --out {out} exists and is not empty")
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(cfg, out)
    log.info(
        "exported %s (step %s, %s) to %s",
        path,
        state["trainer"]["step"],
        layers,
        out,
    )
    return out


#: Bytes of tensors per file of a streamed export (the index names each tensor's file).
SHARD_BYTES = 2 * 1024**3


def _trainer_state(path: Path) -> dict:
    try:
        return torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ConfigError(f"checkpoint {path}: trainer.pt refused or corrupt ({msg})") from None


def _export_streaming(path: Path, cfg, out: Path) -> Path:
    """An INT8 run's export, one tensor at a time: each tensor is read from the checkpoint's
    safetensors file (an INT8 weight's codes and scales dequantized to fp32), written into the
    current output file of at most `SHARD_BYTES`, with HF's index beside them; the model is never
    built, so the memory is one output file's tensors (no INT8 run is factorized: its quantized
    layers are plain linear ones, whose checkpoint keys are already HF's)."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"export: --out {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    shapes, n = _write_shards(_dequantized(path, cfg.train.weight_quant_group), out)
    if "model.embed_tokens.weight" not in shapes:
        raise ConfigError(f"export: checkpoint {path} holds no model.embed_tokens.weight")
    hf = build_hf_config(cfg, shapes["model.embed_tokens.weight"][0])
    hf.dtype = torch.float32
    hf.save_pretrained(out)
    _save_tokenizer(cfg, out)
    log.info("exported %s (INT8 weights dequantized, %d file(s), streamed) to %s", path, n, out)
    return out


def _dequantized(path: Path, group: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) of each tensor of the checkpoint's model.safetensors, one at a time:
    an INT8 weight's codes and scales (groups of `group` columns) dequantized."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for k in list(f.keys()):
            if k.endswith(SCALE_SUFFIX):
                continue
            if k.endswith(CODES_SUFFIX):
                base = k[: -len(CODES_SUFFIX)]
                yield (
                    base + "weight",
                    dequantize_int8(f.get_tensor(k), f.get_tensor(base + SCALE_SUFFIX), group),
                )
            else:
                yield k, f.get_tensor(k).to(torch.float32)


def _write_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], out: Path
) -> tuple[dict[str, tuple[int, ...]], int]:
    """Writes `tensors` into HF safetensors files of at most `SHARD_BYTES` each (one
    model.safetensors, or model-i-of-n files with their index), holding one file's tensors at a
    time; returns each tensor's shape and the number of files."""
    import json

    from safetensors.torch import save_file

    files: list[dict[str, torch.Tensor]] = [{}]
    index: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    sizes = [0]
    total = 0

    def flush(last: bool = False) -> None:
        if not files[-1]:
            return
        save_file(files[-1], str(out / f"part-{len(sizes):05d}.safetensors"), metadata={"format": "pt"})
        files[-1] = {}
        if not last:
            sizes.append(0)

    for name, t in tensors:
        shapes[name] = tuple(t.shape)
        nbytes = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + nbytes > SHARD_BYTES:
            flush()
        files[-1][name] = t.contiguous()
        sizes[-1] += nbytes
        total += nbytes
        index[name] = f"part-{len(sizes):05d}.safetensors"
    flush(last=True)
    n = len(sizes)
    renamed = {}
    for i in range(1, n + 1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        (out / f"part-{i:05d}.safetensors").rename(out / final)
        renamed[f"part-{i:05d}.safetensors"] = final
    if n > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps(
                {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in index.items()}},
                indent=2,
            )
        )
    return shapes, n


def _factored_model(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """`model` (factorized, trained) as a `FactoredLlamaForCausalLM` holding the same tensors, whose
    config records the surgery so that `from_pretrained` rebuilds it."""
    from effpretrain.models.factored_hf import FactoredLlamaConfig, FactoredLlamaForCausalLM

    f = cfg.factor
    factor = {
        "kind": f.kind,
        "rank": f.rank,
        "alpha": f.alpha,
        "targets": list(f.targets),
        "density": f.density,
        "seed": f.seed,
    }
    skip = {"model_type", "architectures", "transformers_version"}
    llama = {k: v for k, v in model.config.to_dict().items() if k not in skip}
    out = FactoredLlamaForCausalLM(FactoredLlamaConfig(factor=factor, **llama))
    out.load_state_dict(model.state_dict())
    return out


def _save_tokenizer(cfg, out: Path) -> None:
    """The run's tokenizer beside the weights: a HF tokenizer (a continued run's is its source
    model's) as it loads, the built-in BPE from its cache; where it cannot be loaded, a note
    naming it."""
    if cfg.data.tokenizer != "builtin-bpe":
        try:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(cfg.data.tokenizer).save_pretrained(out)
        except Exception as e:  # offline hub id, moved folder: the export stands without it
            log.warning(
                "tokenizer %s not saved with the export (%s)", cfg.data.tokenizer, str(e).splitlines()[0]
            )
            (out / "TOKENIZER.txt").write_text(f"trained with the tokenizer {cfg.data.tokenizer}\n")
        return
    from transformers import PreTrainedTokenizerFast

    corpus = data.load_corpus(cfg.data)
    path = data.cache_dir() / "tokenizers" / f"bpe-{corpus.fingerprint()}-{cfg.data.vocab_size}.json"
    if not path.is_file():
        log.warning("built-in tokenizer not in the cache (%s); exported without a tokenizer", path)
        return
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token=data.EOS_TOKEN, pad_token=data.PAD_TOKEN
    )
    tok.save_pretrained(out)
