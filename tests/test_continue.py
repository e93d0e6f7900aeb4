"""Continued pretraining (`model.init`): a run starts from a model folder written by transformers'
`save_pretrained` (a LLaMA sharded with an index, a tied Qwen2, a Mistral; safetensors) and its
tokenizer. Step 0's validation loss is the source model's own loss computed by transformers on the
same tokens; adamw, galore and apollo_mini train from it; a split run ends equal to the straight
one; the export reloads with `AutoModelForCausalLM` and gives `effpretrain eval`'s loss; the
factorized kinds start as their rule says (LoRA and ReLoRA compute the source model, Low-Rank its
best rank-r approximation) or are refused; 2-process DDP and FSDP2 equal one process, and under
FSDP2 a rank holds its shards plus one tensor's rows while loading; bad sources are refused in one
line with nothing written."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from _common import TINY, TINY_OVERRIDES, assert_resumed_from
from distributed_helpers import COMMON, final, rel_diff, run_worker_pair

from effpretrain import cli
from effpretrain import data as data_mod
from effpretrain.config import load_config
from effpretrain.evaluation import evaluate_checkpoint
from effpretrain.export import export
from effpretrain.models.llama import ModelShape, build_model
from effpretrain.models.pretrained import open_pretrained
from effpretrain.trainer import train

VOCAB = 512  # the tiny runs' builtin BPE (TINY_OVERRIDES)
SMALL = {"hidden": 64, "intermediate": 160, "heads": 4, "layers": 2, "kv_heads": 2}
#: The source models: (shape, save_pretrained's max_shard_size: small enough to shard the LLaMA).
SOURCES = {
    "llama_sharded": (ModelShape(**SMALL), "150KB"),
    "qwen2_tied": (ModelShape(**SMALL, tied=True, architecture="Qwen2ForCausalLM"), "50MB"),
    "mistral": (ModelShape(**SMALL, architecture="MistralForCausalLM"), "50MB"),
}
METHODS = ["adamw", "galore", "apollo_mini"]


def _tokenizer_folder(out: Path) -> None:
    """The tiny runs' builtin BPE, saved as a transformers tokenizer into `out`."""
    from transformers import PreTrainedTokenizerFast

    cfg = load_config(TINY / "adamw.yaml", TINY_OVERRIDES)
    corpus = data_mod.load_corpus(cfg.data)
    data_mod.load_tokenizer(cfg.data, corpus)  # trains and caches it if needed
    path = data_mod.cache_dir() / "tokenizers" / f"bpe-{corpus.fingerprint()}-{VOCAB}.json"
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token=data_mod.EOS_TOKEN, pad_token=data_mod.PAD_TOKEN
    )
    tok.save_pretrained(out)


def save_source(shape: ModelShape, out: Path, max_shard_size: str = "50MB") -> Path:
    """A 'pretrained' model: a seeded build whose final norm is scaled, so that its loss is far
    from any fresh initialisation's (a run that ignored the weights could not match it)."""
    model = build_model(shape, vocab_size=VOCAB, max_positions=128, seed=3)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    _tokenizer_folder(out)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {name: save_source(shape, root / name, size) for name, (shape, size) in SOURCES.items()}


def over(source: Path, *extra: str) -> list[str]:
    return [
        *TINY_OVERRIDES,
        f"model.init={source}",
        "data.tokenizer=auto",
        "train.max_steps=20",
        "train.eval_every=10",
        "train.save_every=10",
        "train.log_every=1",
        *extra,
    ]


def evals(run: Path) -> dict[int, float]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["val_loss"] for e in events if e.get("event") == "eval"}


_HF_LOSS: dict[str, float] = {}


def hf_loss(folder: Path) -> float:
    """The token-weighted loss of the model in `folder`, loaded and run by transformers itself
    (its own loss), on the tiny runs' validation rows."""
    from transformers import AutoModelForCausalLM

    key = str(folder)
    if key not in _HF_LOSS:
        cfg = load_config(TINY / "adamw.yaml", over(folder))
        corpus = data_mod.load_corpus(cfg.data)
        tok = data_mod.load_tokenizer(cfg.data, corpus)
        val = data_mod.validation_set(corpus, tok, cfg.data.seq_len, cfg.data.mode, cfg.train.eval_tokens)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(len(val)):
                row = val.rows(i, i + 1)
                n = int((row["labels"][:, 1:] != -100).sum())
                out = model(
                    input_ids=row["input_ids"], attention_mask=row["attention_mask"], labels=row["labels"]
                )
                total += float(out.loss) * n
                count += n
        _HF_LOSS[key] = total / count
    return _HF_LOSS[key]


@pytest.mark.run
@pytest.mark.parametrize(
    "source, method",
    [
        pytest.param(s, m, marks=[pytest.mark.fast] if (s, m) == ("qwen2_tied", "adamw") else [])
        for s in SOURCES
        for m in METHODS
    ],
)
def test_starts_from_the_weights_trains_and_resumes_exactly(sources, tmp_path, source, method):
    """Step 0 is the source model (transformers' loss within 1e-5: the same fp32 model on the same
    tokens, summed in another order); 20 steps lower it; a run resumed at step 10 ends with the
    straight run's weights bitwise (the same operations in the same order once restored)."""
    recipe = TINY / f"{method}.yaml"
    straight = train(load_config(recipe, over(sources[source])), tmp_path / "straight")
    losses = evals(tmp_path / "straight")
    assert sorted(losses) == [0, 10, 20]
    assert abs(losses[0] - hf_loss(sources[source])) <= 1e-5, (losses[0], hf_loss(sources[source]))
    assert losses[20] < losses[0] - 0.05, losses
    assert straight["weight_bytes"] == straight["estimated"]["weights"]
    (load,) = straight["init_load"]
    assert load["bytes_read"] == straight["weight_bytes"]  # fp32 files into an fp32 run: every weight, once
    resumed = train(
        load_config(recipe, over(sources[source])),
        tmp_path / "resumed",
        resume=str(tmp_path / "straight" / "checkpoints" / "step-10"),
    )
    a, b = final(tmp_path / "straight"), final(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    assert_resumed_from(tmp_path / "straight", tmp_path / "resumed", 10)


@pytest.mark.run
@pytest.mark.parametrize("source", list(SOURCES))
def test_export_reloads_and_gives_the_eval_loss(sources, tmp_path, source):
    """The export of a run from `model.init` is a folder transformers loads as the source's
    class; its loss (transformers') equals `effpretrain eval` of the checkpoint within 1e-5; the
    tokenizer travels with it."""
    from transformers import AutoTokenizer

    overrides = over(sources[source], "train.max_steps=10", "train.save_every=10")
    train(load_config(TINY / "adamw.yaml", overrides), tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step-10"
    ours = evaluate_checkpoint(ckpt)["val_loss"]
    out = export(tmp_path / "run", tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["architectures"] == [SOURCES[source][0].architecture]
    assert len(AutoTokenizer.from_pretrained(out)) == VOCAB
    assert abs(hf_loss(out) - ours) <= 1e-5, (hf_loss(out), ours)
    assert abs(ours - hf_loss(sources[source])) > 1e-3  # it trained: not the source's loss


@pytest.mark.run
def test_factorized_kinds_start_by_their_rule(sources, tmp_path):
    """LoRA and ReLoRA keep the weight as the frozen W0 with B = 0: step 0 is the source model.
    Low-Rank starts at the truncated SVD: at full rank it is the source model (within fp32 SVD
    error), at rank r each layer is W's best rank-r approximation (Eckart-Young: the residual's
    Frobenius norm is that of the dropped singular values)."""
    from effpretrain.run_model import build_run_model

    src = sources["llama_sharded"]
    for kind in ("lora", "relora"):
        train(load_config(TINY / f"{kind}.yaml", over(src, "train.max_steps=1")), tmp_path / kind)
        assert abs(evals(tmp_path / kind)[0] - hf_loss(src)) <= 1e-5, kind
    full = over(
        src,
        "train.max_steps=1",
        "factor.rank=64",
        "factor.targets=[q_proj,o_proj,gate_proj,up_proj,down_proj]",
    )
    train(load_config(TINY / "lowrank.yaml", full), tmp_path / "lowrank")
    assert abs(evals(tmp_path / "lowrank")[0] - hf_loss(src)) <= 1e-4

    cfg = load_config(TINY / "lowrank.yaml", over(src, "factor.rank=8"))
    weights = open_pretrained(str(src))[0]
    model, report = build_run_model(cfg, VOCAB, weights)
    source = read_model_state_of(src)
    for name in report["replaced"]:
        layer = model.get_submodule(name)
        w = source[f"{name}.weight"].double()
        sv = torch.linalg.svdvals(w)
        residual = (w - layer.scale * layer.B.double() @ layer.A.double()).norm()
        assert abs(float(residual.detach()) - float(sv[8:].norm())) <= 1e-4 * float(w.norm()), name


def read_model_state_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_reader_reads_rows_and_casts_as_safetensors_does(sources, tmp_path):
    """Our reader against the safetensors library: whole tensors, row ranges, and a bf16 file
    read into fp32 (exact: bf16 widens losslessly)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = open_pretrained(str(sources["llama_sharded"]))[0]
    assert len({e.file for e in weights.entries.values()}) > 1  # sharded with an index
    for name, e in list(weights.entries.items())[:6]:
        with safe_open(e.file, "pt") as f:
            ref = f.get_tensor(name)
            rows = f.get_slice(name)[1:3]
        got = torch.empty(e.shape, dtype=e.dtype)
        weights.read_into(name, got)
        assert torch.equal(got, ref), name
        part = torch.empty((2, *e.shape[1:]), dtype=e.dtype)
        weights.read_into(name, part, (1, 3))
        assert torch.equal(part, rows), name
    half = tmp_path / "bf16"
    half.mkdir()
    (half / "config.json").write_text((sources["mistral"] / "config.json").read_text())
    state = {k: v.to(torch.bfloat16) for k, v in read_model_state_of(sources["mistral"]).items()}
    save_file(state, half / "model.safetensors")
    w16 = open_pretrained(str(half))[0]
    dest = torch.empty(state["lm_head.weight"].shape)
    w16.read_into("lm_head.weight", dest)
    assert torch.equal(dest, state["lm_head.weight"].float())


@pytest.mark.run
def test_one_process_load_holds_the_model_once(sources, tmp_path):
    """On one process the load's peak (tensor accounting) is the model plus one tensor's buffer at
    most, in fp32; in bf16-pure the units are cast as read: the bf16 model plus one unit in fp32."""
    src = sources["llama_sharded"]
    fp32 = train(load_config(TINY / "adamw.yaml", over(src, "train.max_steps=1")), tmp_path / "fp32")
    (load,) = fp32["init_load"]
    assert load["filled_bytes"] >= fp32["weight_bytes"] and load["bytes_read"] == fp32["weight_bytes"]
    assert load["peak_bytes"] <= load["filled_bytes"] + load["largest_read_bytes"], load
    bf16 = train(
        load_config(TINY / "adamw.yaml", over(src, "train.max_steps=1", "train.precision=bf16-pure")),
        tmp_path / "bf16",
    )
    (load16,) = bf16["init_load"]
    layer_fp32 = sum(
        v.numel() * 4 for k, v in read_model_state_of(src).items() if k.startswith("model.layers.0.")
    )
    embedding_fp32 = VOCAB * 64 * 4
    assert (
        load16["peak_bytes"]
        <= load16["filled_bytes"] + max(layer_fp32, embedding_fp32) + load16["largest_read_bytes"]
    )
    assert load16["peak_bytes"] < load["filled_bytes"]  # never the fp32 model whole


WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    root, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    common = sys.argv[4:]
    recipe = root / "recipes" / "tiny" / "adamw.yaml"
    if mode == "one":  # the ranks' micro-batches, one after the other
        train(load_config(recipe, common + ["train.batch_size=2", "train.grad_accum=2"]), out / "one")
    else:
        for sharding in ("ddp", "fsdp2"):
            train(load_config(recipe, common + ["train.batch_size=2", f"dist.sharding={sharding}"]), out / sharding)
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["llama_sharded", "qwen2_tied"])
def test_two_processes_from_the_folder_equal_one(sources, tmp_path, source):
    """2-process DDP (every rank reads) and FSDP2 (each rank reads its rows) from the same folder
    equal one process at the same global batch: step 0 equal to transformers' loss, the final
    loss within 1e-5 and the weights within 1e-5 (the reduction sums in another order). Under
    FSDP2 each rank filled about half the model and held at most its shards plus one tensor's
    rows while loading (tensor accounting)."""
    common = [*COMMON, f"model.init={sources[source]}", "data.tokenizer=auto", "train.eval_every=10"]
    run_worker_pair(WORKER, tmp_path, common)
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    for sharding in ("ddp", "fsdp2"):
        two = json.loads((tmp_path / sharding / "summary.json").read_text())
        assert abs(evals(tmp_path / sharding)[0] - hf_loss(sources[source])) <= 1e-5, sharding
        assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * one["final_val_loss"], sharding
        assert rel_diff(final(tmp_path / sharding), final(tmp_path / "one")) <= 1e-5, sharding
    whole = one["init_load"][0]["filled_bytes"]
    ranks = json.loads((tmp_path / "fsdp2" / "summary.json").read_text())["init_load"]
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["filled_bytes"] <= 0.6 * whole, rank
        assert rank["peak_bytes"] <= rank["filled_bytes"] + rank["largest_read_bytes"], rank
        assert rank["largest_read_bytes"] < one["init_load"][0]["largest_read_bytes"], (
            rank
        )  # rows, not tensors


def _bad_sources(root: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """Each bad source, and what its one-line error says."""
    import shutil

    def copy(name: str) -> Path:
        dest = root / name
        shutil.copytree(good, dest)
        return dest

    def edit_config(folder: Path, **changes) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))

    no_weights = copy("no_weights")
    (no_weights / "model.safetensors").unlink()
    gpt2 = copy("gpt2")
    edit_config(gpt2, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    remote = copy("remote")
    edit_config(remote, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    shapes = copy("shapes")
    edit_config(shapes, intermediate_size=128)
    truncated = copy("truncated")
    blob = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(blob[: len(blob) - 1000])
    return {
        "no weights": (no_weights, "no safetensors weights in this folder"),
        "unsupported architecture": (gpt2, "GPT2LMHeadModel is not supported"),
        "trust_remote_code": (remote, "needs trust_remote_code"),
        "mismatched shapes": (shapes, "has shape [160, 64] in"),
        "truncated file": (truncated, "model.safetensors is truncated"),
        "missing folder": (root / "nowhere", "no such folder"),
    }


@pytest.mark.run
def test_bad_sources_one_line_exit_2_nothing_written(sources, tmp_path, capsys):
    bad = _bad_sources(tmp_path / "bad", sources["mistral"])
    recipe = str(TINY / "adamw.yaml")
    cases = [(name, over(folder), needle) for name, (folder, needle) in bad.items()]
    src = sources["mistral"]
    cases += [
        ("sltrain", over(src, "factor.kind=sltrain"), "factor.kind=sltrain defines no start from pretrained"),
        ("config and init", over(src, f"model.config={src}"), "leave model.config empty"),
        ("fsdp2 surgery", over(src, "factor.kind=lora", "dist.sharding=fsdp2"), "not supported there yet"),
        (
            "tokenizer larger",
            over(src, "data.tokenizer=builtin-bpe", "data.vocab_size=1024"),
            "has 1024 tokens",
        ),
    ]
    for name, overrides, needle in cases:
        out = tmp_path / "runs" / name.replace(" ", "_")
        args = ["train", recipe, "--out", str(out)]
        for o in overrides:
            args += ["--set", o]
        rc = cli.main(args)
        err = [
            ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and ln.startswith("effpretrain")
        ]
        assert rc == 2, name
        assert len(err) == 1 and needle in err[0], (name, err)
        assert not out.exists(), name  # nothing written for a rejected run
    assert math.isfinite(hf_loss(src))


def test_continue_recipes_and_their_documented_memory():
    """One recipe per family, each naming a published source of that family, whose shape is a
    preset's (`HUB_SHAPES`): the docs' table of their parameters and memory is the estimator's."""
    from effpretrain import memory
    from effpretrain.models.llama import HUB_SHAPES, PRESETS, model_shape

    families = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    recipes = sorted((TINY.parent / "continue").glob("*.yaml"))
    assert [p.stem for p in recipes] == sorted(families)
    page = (TINY.parent.parent / "docs" / "continue.md").read_text()
    for path in recipes:
        cfg = load_config(path)
        assert cfg.model.init in HUB_SHAPES and cfg.data.tokenizer == cfg.model.init
        shape = model_shape(cfg.model)
        assert shape == PRESETS[HUB_SHAPES[cfg.model.init]] and shape.architecture == families[path.stem]
        est = memory.estimate_from_config(cfg, None)
        row = next(ln for ln in page.splitlines() if ln.startswith(f"| `recipes/continue/{path.name}`"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == cfg.model.init and cells[2].split()[0] == cfg.optim.name, row
        assert cells[3:] == [
            f"{est.params:,}",
            f"{est.weights_plus_optimizer / 1e9:.3f} GB",
            f"{est.peak / 1e9:.3f} GB",
        ], row


@pytest.mark.run
def test_int8_weights_start_from_the_quantized_source(sources, tmp_path):
    """With INT8 weights each layer is quantized as it is read: the weights' bytes are the
    estimate's, and step 0 is the source model up to its INT8 rounding (to nearest, group 128:
    within 1% of its loss here), then it trains."""
    src = sources["qwen2_tied"]
    run = train(
        load_config(TINY / "adamw.yaml", over(src, "train.weight_quant=int8", "train.max_steps=10")),
        tmp_path / "int8",
    )
    losses = evals(tmp_path / "int8")
    assert run["weight_bytes"] == run["estimated"]["weights"]
    assert abs(losses[0] - hf_loss(src)) <= 1e-2 * hf_loss(src), (losses[0], hf_loss(src))
    assert losses[0] != hf_loss(src)  # quantized: not the fp32 model itself
    assert losses[10] < losses[0]
