"""`effpretrain export RUN_DIR --out DIR`: a plain HuggingFace folder from a run's checkpoint.

Factorized layers (Low-Rank, LoRA, ReLoRA, SLTrain) are merged into dense weights, so the folder
loads with `AutoModelForCausalLM.from_pretrained(DIR)` and gives the trained model's outputs. The
built-in tokenizer, when the run used it, is saved beside the model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from effpretrain.checkpoint import find_resume, load_checkpoint, read_model_state
from effpretrain.config import ConfigError, from_dict, validate

log = logging.getLogger("effpretrain")


def export(run_or_ckpt: str | Path, out: str | Path) -> Path:
    """Writes the merged model of the newest complete checkpoint of a run (or of one checkpoint)."""
    from effpretrain.models import merge_factorized_
    from effpretrain.run_model import build_run_model

    src = Path(run_or_ckpt)
    path = find_resume(src, "auto") if (src / "checkpoints").is_dir() else src
    if path is None or not path.exists():
        raise ConfigError(f"export: {run_or_ckpt} holds no complete checkpoint")
    state = load_checkpoint(path)
    cfg = validate(from_dict(state["trainer"]["config"], str(path)), str(path))
    weights = read_model_state(path, state)  # whole, also from an FSDP2 run's sharded dcp/
    vocab = weights["model.embed_tokens.weight"].shape[0]
    model, _ = build_run_model(cfg, vocab)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if k in dict(model.named_parameters())]:
        raise ConfigError(f"export: checkpoint {path} does not match its config's model")
    merged = merge_factorized_(model)
    model = model.to(torch.float32)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"export: --out {out} exists and is not empty")
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(cfg, out)
    log.info(
        "exported %s (step %s, %d factorized layers merged) to %s",
        path,
        state["trainer"]["step"],
        merged,
        out,
    )
    return out


def _save_tokenizer(cfg, out: Path) -> None:
    if cfg.data.tokenizer != "builtin-bpe":
        (out / "TOKENIZER.txt").write_text(f"trained with the tokenizer {cfg.data.tokenizer}\n")
        return
    from transformers import PreTrainedTokenizerFast

    from effpretrain import data

    corpus = data.load_corpus(cfg.data)
    path = data.cache_dir() / "tokenizers" / f"bpe-{corpus.fingerprint()}-{cfg.data.vocab_size}.json"
    if not path.is_file():
        log.warning("built-in tokenizer not in the cache (%s); exported without a tokenizer", path)
        return
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token=data.EOS_TOKEN, pad_token=data.PAD_TOKEN
    )
    tok.save_pretrained(out)
