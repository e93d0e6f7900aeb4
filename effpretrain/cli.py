"""`effpretrain train | estimate | eval | export | prepare`: the console script and `python -m effpretrain`.

Bad input (config, data, paths, checkpoints) exits with code 2 and one line naming the problem.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

import optimizers
from effpretrain.checkpoint import CheckpointWriteError
from effpretrain.config import PRECISIONS, OptimConfig, TrainConfig, load_config
from effpretrain.data.prepare_tokens import prepare
from effpretrain.data.tokens import DEFAULT_SHARD_TOKENS
from effpretrain.errors import ConfigError
from effpretrain.loss import LossKind
from effpretrain.memory import estimate, estimate_from_config, format_table
from effpretrain.memory.published import RECIPES
from effpretrain.models import FACTOR_KINDS, PRESETS
from effpretrain.models.llama import load_hf_config, model_label, shape_of
from effpretrain.signals import RunInterrupted

DEFAULT_RECIPE = "recipes/tiny/adamw.yaml"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is 2 already; keep one line
        self.exit(2, f"effpretrain: error: {message}\n")


#: `--dtype` values: the canonical precision names (config's `train.precision`) plus the CLI-only
#: shorthand `bf16` for `bf16-pure`.
DTYPE_CHOICES = (*PRECISIONS, "bf16")


def _precision(dtype: str) -> str:
    """The canonical precision name for a `--dtype` value (`bf16` is shorthand for `bf16-pure`)."""
    return "bf16-pure" if dtype == "bf16" else dtype


def _add_overrides(p: argparse.ArgumentParser, text: str | None = None) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=text)


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train from a recipe (default: the tiny AdamW recipe, built-in corpus)")
    t.add_argument("recipe", nargs="?", help="recipe YAML; omitted: the default recipe")
    t.add_argument("--out", help="run directory (default: runs/<method>-<preset>)")
    _add_overrides(t, "override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    t.add_argument("--resume", metavar="DIR|auto", help="resume from a checkpoint/run dir, or 'auto'")
    t.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even if model/method/batch/data differ from the checkpoint's",
    )
    t.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="run even when the estimated peak memory exceeds the device's (the pre-flight check)",
    )


def _add_estimate(sub) -> None:
    from typing import get_args

    e = sub.add_parser("estimate", help="analytic memory breakdown (no model is built)")
    which = e.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="preset, e.g. llama_1b or llama_7b")
    which.add_argument(
        "--recipe",
        metavar="PATH",
        help="a training recipe, estimated as `train` would run it on one process (the other flags "
        "but --json are ignored; use --set to change it)",
    )
    which.add_argument(
        "--config",
        metavar="PATH",
        help="an HF config of a supported architecture (Llama, Mistral, Qwen2, Qwen3): a config.json, "
        "its folder, or a hub id where the network is reachable",
    )
    e.add_argument(
        "--method",
        default="adamw",
        help="a method as the leaderboard names it: an optimizer (adamw, galore, ...), a factorization "
        "(lowrank, lora, relora, sltrain, ...) or a variant (lowrank_restarts, sltrain_restarts, ...)",
    )
    e.add_argument("--rank", type=int, default=None, help="projection / factor rank")
    e.add_argument(
        "--dtype",
        default="bf16-pure",
        choices=DTYPE_CHOICES,
        help="storage precision, as train.precision: fp32, bf16-mixed, bf16-pure (default); "
        "bf16 is shorthand for bf16-pure",
    )
    e.add_argument("--vocab-size", type=int, default=None)
    e.add_argument("--batch-size", type=int, default=1, help="sequences per rank (activations)")
    e.add_argument("--seq-len", type=int, default=256)
    e.add_argument("--activation-checkpointing", type=int, default=0, metavar="K")
    e.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step (held gradients)")
    e.add_argument(
        "--update-in-backward",
        action="store_true",
        help="as train.update_in_backward: gradients become accumulators + gradients in flight",
    )
    e.add_argument(
        "--grad-clip",
        type=float,
        default=TrainConfig.grad_clip,
        help="as train.grad_clip (with --update-in-backward, 0 allows GaLore's low-rank accumulators)",
    )
    e.add_argument(
        "--in-backward-refresh",
        default=TrainConfig.in_backward_refresh,
        choices=["accumulated", "first_micro"],
        help="as train.in_backward_refresh (first_micro: accumulators stay low rank at a refresh step)",
    )
    e.add_argument("--loss", default=TrainConfig.loss, choices=list(get_args(LossKind)), help="as train.loss")
    e.add_argument("--world-size", type=int, default=1)
    e.add_argument("--sharding", default="none", choices=["none", "ddp", "fsdp2"])
    _add_weight_quant_args(e)
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_overrides(e, "with --recipe: override a recipe value, e.g. --set train.batch_size=2 (repeatable)")


def _add_weight_quant_args(e) -> None:
    """`estimate`'s settings of weights stored in fewer bits (train.weight_quant and its keys)."""
    e.add_argument(
        "--weight-quant",
        default="none",
        choices=["none", "int8"],
        help="as train.weight_quant: int8 stores the target linear weights as int8 codes + fp32 scales",
    )
    e.add_argument(
        "--weight-quant-group",
        type=int,
        default=TrainConfig.weight_quant_group,
        help="as train.weight_quant_group",
    )
    e.add_argument(
        "--weight-quant-embeddings",
        action="store_true",
        help="as train.weight_quant_embeddings: the embedding and the head in INT8 too",
    )
    e.add_argument(
        "--stochastic-rounding",
        action="store_true",
        help="as train.stochastic_rounding: true (the default for --weight-quant int8); the rounding's "
        "noise is part of the writer's temporaries",
    )


def _add_prepare(sub) -> None:

    p = sub.add_parser(
        "prepare", help="tokenise a corpus once into memory-mapped shards (train with data.source=tokens)"
    )
    p.add_argument(
        "source", help="builtin, or a .txt/.jsonl/.jsonl.gz/.parquet file, a folder of them, or a glob"
    )
    p.add_argument("--out", required=True, help="output folder (new or empty; then data.path=OUT)")
    p.add_argument(
        "--tokenizer", default="builtin-bpe", help="builtin-bpe (default) or a HF tokenizer name/path"
    )
    p.add_argument("--vocab-size", type=int, default=8192, help="builtin-bpe only (as data.vocab_size)")
    p.add_argument("--text-field", default="text", help=".jsonl/.parquet field holding the text")
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help="tokens per shard (documents never split)",
    )
    p.add_argument(
        "--val-every",
        type=int,
        default=50,
        help="one in N documents is held out, by data.val_every's rule (builtin: every Nth; files: text hash)",
    )
    p.add_argument("--force", action="store_true", help="overwrite a previous prepare in --out")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="effpretrain", description="Memory-efficient LLM pretraining.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    _add_train(sub)
    _add_estimate(sub)
    x = sub.add_parser("export", help="merge factorized layers and write a HuggingFace model folder")
    x.add_argument("run", help="run directory (newest complete checkpoint) or a checkpoint folder")
    x.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    v = sub.add_parser(
        "eval", help="validation loss/perplexity of a checkpoint (one process or torchrun; same result)"
    )
    v.add_argument("checkpoint", help="checkpoint folder or run directory")
    _add_overrides(v)
    _add_prepare(sub)
    return p


def cmd_train(args) -> int:
    from effpretrain.trainer import NonFiniteError, train

    recipe = args.recipe
    if recipe is None:
        recipe = _default_recipe()
    cfg = load_config(recipe, args.overrides)
    out = Path(args.out) if args.out else _default_out(cfg, args.resume)
    try:
        summary = train(cfg, out, args.resume, args.allow_config_change, args.allow_oversubscribe)
    except NonFiniteError as e:
        print(f"effpretrain: training stopped: {e}", file=sys.stderr)
        return 3
    except CheckpointWriteError as e:
        print(f"effpretrain: error: {e}", file=sys.stderr)
        return e.EXIT_CODE
    except RunInterrupted as e:
        print(f"effpretrain: {e}", file=sys.stderr)
        return e.exit_code
    if "final_val_ppl" in summary and os.environ.get("LOCAL_RANK", "0") == "0":
        print(
            f"done: {summary['steps']} steps, {summary['tokens']:,} tokens, val_loss {summary['final_val_loss']:.4f}, "
            f"val_ppl {summary['final_val_ppl']:.2f}, {summary['tokens_per_s']:,.0f} tokens/s -> {out}"
        )
    return 0


def _default_recipe() -> str:
    """The packaged default recipe, found beside the source tree or in the working directory."""
    for base in (Path.cwd(), Path(__file__).resolve().parent.parent):
        cand = base / DEFAULT_RECIPE
        if cand.is_file():
            return str(cand)
    raise ConfigError(f"no recipe given and the default {DEFAULT_RECIPE} was not found")


def _default_out(cfg, resume: str | None) -> Path:
    if resume and resume != "auto":
        p = Path(resume)
        # A checkpoint folder runs/X/checkpoints/step-N resumes into runs/X.
        return p.parent.parent if p.parent.name == "checkpoints" else p
    if resume == "auto":
        return Path("runs") / f"{cfg.method}-{model_label(cfg.model)}"
    return Path("runs") / f"{cfg.method}-{model_label(cfg.model)}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_estimate(args) -> int:

    if args.recipe:
        return _estimate_recipe(args)
    if args.config:
        try:
            model = shape_of(load_hf_config(args.config))
        except ValueError as e:
            raise ConfigError(f"--config: {e}") from None
    elif args.model not in PRESETS:
        raise ConfigError(f"--model {args.model!r} is not one of {', '.join(PRESETS)}")
    else:
        model = args.model
    method, factor, restarts = _method_structure(args.method)
    sizes = {"--rank": args.rank, "--world-size": args.world_size, "--batch-size": args.batch_size}
    sizes["--grad-accum"] = args.grad_accum
    sizes["--weight-quant-group"] = args.weight_quant_group
    sizes.update({"--seq-len": args.seq_len, "--vocab-size": args.vocab_size})
    for flag, value in sizes.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    if args.activation_checkpointing < 0:
        raise ConfigError(f"--activation-checkpointing must be >= 0, got {args.activation_checkpointing}")
    rank = args.rank or 128
    sharding = args.sharding if args.sharding != "none" or args.world_size == 1 else "ddp"
    est = estimate(
        model,
        method,
        dtype=_precision(args.dtype),
        vocab_size=args.vocab_size,
        optim_cfg=OptimConfig(name=method, rank=rank),
        factor_kind=factor,
        factor_rank=rank,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing,
        world_size=args.world_size,
        sharding=sharding,
        grad_accum=args.grad_accum,
        loss=args.loss,
        restarts=restarts,
        update_in_backward=args.update_in_backward,
        grad_clip=args.grad_clip,
        in_backward_refresh=args.in_backward_refresh,
        weight_quant=args.weight_quant,
        weight_quant_group=args.weight_quant_group,
        weight_quant_embeddings=args.weight_quant_embeddings,
        stochastic_rounding=True if args.stochastic_rounding else None,
    )
    if factor != "none":
        est.detail["method"] = args.method
    if args.json:
        print(json.dumps(est.as_dict(), indent=2))
    else:
        print(format_table(est))
    return 0


def _estimate_recipe(args) -> int:
    """`estimate --recipe`: the recipe's run as the trainer's pre-flight estimates it (the builtin
    tokenizer's configured vocabulary, else the model's)."""
    cfg = load_config(args.recipe, args.overrides)
    vocab = cfg.data.vocab_size if cfg.data.tokenizer == "builtin-bpe" else None
    est = estimate_from_config(cfg, vocab, 1, "none")
    print(json.dumps(est.as_dict(), indent=2) if args.json else format_table(est))
    return 0


def _method_structure(name: str) -> tuple[str, str, bool]:
    """(optimizer, factor kind, restarts on) of a method as the leaderboard names it.

    The names are the tiny recipes' stems (`recipes/tiny/*.yaml`: every registered optimizer and
    factor kind, and the variants such as `lowrank_restarts`), and each recipe states the structure:
    `optim.name`, `factor.kind`, `restarts.every > 0` (ReLoRA merges and LORO steps exactly on
    restarts, so both have them). Without the recipes folder (an installed wheel), a registered
    optimizer or factor kind is taken from the registries alone."""

    recipes = RECIPES / "tiny"
    names = sorted({p.stem for p in recipes.glob("*.yaml")} | set(optimizers.METHODS) | set(FACTOR_KINDS))
    if name not in names:
        raise ConfigError(f"--method {name!r} is not one of {', '.join(names)}")
    if (recipes / f"{name}.yaml").is_file():
        cfg = load_config(str(recipes / f"{name}.yaml"))
        return cfg.optim.name, cfg.factor.kind, cfg.restarts.every > 0
    return _registry_structure(name)


def _registry_structure(name: str) -> tuple[str, str, bool]:
    """`_method_structure` of a registered optimizer or factor kind from the registries alone (a
    test holds it equal to the tiny recipe's)."""

    if name in FACTOR_KINDS:  # factors train with the default optimizer; ReLoRA merges on restarts
        return OptimConfig().name, name, FACTOR_KINDS[name].merges_at_restart
    spec = optimizers.method_spec(name)  # LORO steps the pure Low-Rank model's factor pairs
    return name, "lowrank" if spec.steps_factor_pairs else "none", spec.restart_period_arg is not None


def cmd_eval(args) -> int:
    from effpretrain.trainer import evaluate_checkpoint

    result = evaluate_checkpoint(args.checkpoint, args.overrides)
    if os.environ.get("RANK", "0") == "0":  # one line however many processes evaluated
        print(json.dumps(result))
    return 0


def cmd_export(args) -> int:
    from effpretrain.export import export

    out = export(args.run, args.out)
    print(f"exported to {out}")
    return 0


def cmd_prepare(args) -> int:

    m = prepare(
        args.source,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens,
        val_every=args.val_every,
        force=args.force,
    )
    tr, va = m["splits"]["train"], m["splits"]["val"]
    print(
        f"prepared {tr['tokens']:,} train tokens ({tr['documents']:,} documents, {len(tr['shards'])} shards) and "
        f"{va['tokens']:,} held-out tokens ({va['documents']:,} documents) as {m['dtype']} -> {args.out}; "
        f"train with data.source=tokens data.path={args.out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "urllib3", "datasets", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # torch.distributed.checkpoint logs every save/load event, and any failure as a multi-line
    # record; a failure reaches the user as effpretrain's own one-line error instead.
    logging.getLogger("c10d-NullHandler-dcp_logger").setLevel(logging.CRITICAL)
    args = _parser().parse_args(argv)
    finished = False
    try:
        commands = {"train": cmd_train, "estimate": cmd_estimate, "eval": cmd_eval, "export": cmd_export}
        rc = {**commands, "prepare": cmd_prepare}[args.cmd](args)
        finished = True
        return rc
    except ConfigError as e:
        print(f"effpretrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("effpretrain: interrupted", file=sys.stderr)
        return 130
    finally:
        end_process_group(together=finished)


def end_process_group(together: bool) -> None:
    """Tears down this process's torch.distributed group before the interpreter exits (torch asks
    for it: a gloo group left to the exit's destructors can abort the process after a finished run).
    After a finished command the ranks first meet in a barrier, so that none closes its gloo
    connections while a peer still has a message in flight on them (a rank then aborted at exit,
    "terminate called without an active exception", now and then on a loaded machine); after an
    error no barrier, which a rank that failed alone would never reach. DTensor's caches are
    emptied first (`_drop_dtensor_caches`): without that, under FSDP2 the group outlived
    `destroy_process_group` and the abort stayed possible after the barrier.

    Also the end of any script of several processes built on effpretrain (benchmarks, test
    workers): ``end_process_group(together=True)`` as their last line."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if together:
            dist.barrier()
        _drop_dtensor_caches()
        dist.destroy_process_group()
        gc.collect()


def _drop_dtensor_caches() -> None:
    """Empties DTensor's process-wide caches of sharding propagation, redistribution plans and
    planners.
    Their entries hold device meshes, and a live mesh keeps its gloo group (and the group's
    threads) alive past `destroy_process_group` until the interpreter's exit, where its destruction
    could abort the process after a finished run. Emptied, the group is destroyed here."""
    try:
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without DTensor: no cache holds a mesh
        return
    _clear_sharding_prop_cache()
    for fn in vars(_redistribute).values():
        if callable(getattr(fn, "cache_clear", None)):
            fn.cache_clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:  # its planners (one per mesh and tensor) hold their meshes
        clear_planners()


if __name__ == "__main__":
    sys.exit(main())
