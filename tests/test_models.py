"""Models of the LLaMA family from an HF config (`model.config`): a LLaMA with grouped-query
attention, a Mistral, a Qwen2 with tied embeddings and q/k/v biases, a Qwen3 with q/k norms and a
head size of its own. Each trains with one method of every family; validation perplexity falls,
weights, gradients and optimizer state equal the estimate exactly, a split run equals the straight
one bitwise; 2-process DDP and FSDP2 equal one process on the tied Qwen2; the presets above 1B have
the parameter counts of the models they name; bad configs are refused in one line."""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _common import ROOT, TINY, TINY_OVERRIDES, assert_resumed_from
from distributed_helpers import COMMON, final, rel_diff, run_worker_pair

from effpretrain import flops, memory
from effpretrain.checkpoint import read_model_state
from effpretrain.config import load_config
from effpretrain.errors import ConfigError
from effpretrain.models.llama import PRESETS, ModelShape, build_llama_config, build_model, shape_of
from effpretrain.trainer import train

VOCAB = 512  # the tiny runs' builtin BPE (TINY_OVERRIDES)
SMALL = {"hidden": 64, "intermediate": 160, "heads": 4, "layers": 2, "kv_heads": 2}
#: One small config per supported family.
FAMILIES = {
    "llama_gqa": ModelShape(**SMALL),
    "mistral": ModelShape(**SMALL, architecture="MistralForCausalLM"),
    "qwen2_tied": ModelShape(**SMALL, tied=True, qkv_bias=True, architecture="Qwen2ForCausalLM"),
    "qwen3": ModelShape(**SMALL, head_dim=32, tied=True, architecture="Qwen3ForCausalLM"),
}
#: One method per family of methods: full-rank, projected, projected 8-bit-free APOLLO,
#: whole-matrix, block-wise, factorized with restarts, sparse plus low-rank.
METHODS = ["adamw", "galore", "apollo_mini", "muon", "adam_mini", "lowrank_restarts", "sltrain"]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("configs")
    for name, shape in FAMILIES.items():
        shape.hf_config(VOCAB, 128).save_pretrained(root / name)
    return {name: root / name for name in FAMILIES}


def overrides(config: Path, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, f"model.config={config}", "train.max_steps=20", "train.eval_every=10", *extra]


def evals(run: Path) -> list[float]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [e["val_ppl"] for e in events if e.get("event") == "eval"]


@pytest.mark.run
@pytest.mark.parametrize(
    "family, method",
    [
        pytest.param(f, m, marks=[pytest.mark.fast] if (f, m) == ("qwen2_tied", "adam_mini") else [])
        for f in FAMILIES
        for m in METHODS
    ],
)
def test_family_trains_matches_the_estimate_and_resumes_exactly(configs, tmp_path, family, method):
    over = overrides(configs[family], "train.save_every=10", "train.log_every=1")
    cfg = load_config(TINY / f"{method}.yaml", over)
    straight = train(cfg, tmp_path / "straight")
    assert straight["model"] == family and straight["vocab_size"] == VOCAB
    ppl = evals(tmp_path / "straight")
    assert len(ppl) == 2 and ppl[1] < ppl[0] < VOCAB, ppl  # perplexity falls from near-uniform
    est = straight["estimated"]
    assert straight["weight_bytes"] == est["weights"]  # a tied matrix counted once on both sides
    assert straight["grad_bytes"] == est["grads"]
    assert straight["optimizer_state_bytes"] == est["optimizer_state"]
    assert straight["params"] == est["params"]
    resumed = train(
        load_config(TINY / f"{method}.yaml", over),
        tmp_path / "resumed",
        resume=str(tmp_path / "straight" / "checkpoints" / "step-10"),
    )
    a = read_model_state(tmp_path / "straight" / "checkpoints" / "step-20")
    b = read_model_state(tmp_path / "resumed" / "checkpoints" / "step-20")
    # Bitwise: the same operations in the same order once the state is restored.
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    assert_resumed_from(tmp_path / "straight", tmp_path / "resumed", 10)


WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    root, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    methods, common = json.loads(sys.argv[4]), sys.argv[5:]  # {method: its shardings}
    for m, shardings in methods.items():
        recipe = root / "recipes" / "tiny" / f"{m}.yaml"
        if mode == "one":  # the ranks' micro-batches, one after the other
            train(load_config(recipe, common + ["train.batch_size=2", "train.grad_accum=2"]), out / f"{m}-1p")
            continue
        for sharding in shardings:
            over = common + ["train.batch_size=2", f"dist.sharding={sharding}", "train.save_every=10",
                             "train.log_every=1"]
            train(load_config(recipe, over), out / f"{m}-{sharding}")
        step10 = out / f"{m}-fsdp2" / "checkpoints" / "step-10"  # resumed from a sharded checkpoint
        train(load_config(recipe, over), out / f"{m}-fsdp2-resumed", resume=str(step10))
    """
)
PARITY_METHODS = ["adamw", "galore"]


@pytest.mark.multiprocess
def test_tied_qwen2_two_processes_equal_one(configs, tmp_path):
    """DDP and FSDP2 (2 processes) on a model whose head is its embedding: one parameter, one
    optimizer state, the same weights as one process at the same global batch; the sharded
    checkpoint stores the matrix once and resumes exactly."""
    common = [*COMMON, f"model.config={configs['qwen2_tied']}"]
    run_worker_pair(WORKER, tmp_path, [json.dumps({m: ["ddp", "fsdp2"] for m in PARITY_METHODS}), *common])
    for m in PARITY_METHODS:
        one = json.loads((tmp_path / f"{m}-1p" / "summary.json").read_text())
        for sharding in ("ddp", "fsdp2"):
            run = tmp_path / f"{m}-{sharding}"
            two = json.loads((run / "summary.json").read_text())
            assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * one["final_val_loss"], (
                m,
                sharding,
            )
            assert rel_diff(final(run), final(tmp_path / f"{m}-1p")) <= 1e-5, (m, sharding)
            assert "lm_head.weight" not in final(run)  # stored once, under the embedding's key
            assert two["estimate_matches_measured"]["optimizer_state"], (m, sharding)
            assert two["weight_bytes"] == two["estimated"]["weights"], (m, sharding)
        # Bitwise: the same operations in the same order once the state is restored.
        resumed, straight = final(tmp_path / f"{m}-fsdp2-resumed"), final(tmp_path / f"{m}-fsdp2")
        # Bitwise: the resumed run executes the same kernels in the same order as the straight one.
        assert (
            all(torch.equal(resumed[k], straight[k]) for k in straight) and resumed.keys() == straight.keys()
        )
        assert_resumed_from(tmp_path / f"{m}-fsdp2", tmp_path / f"{m}-fsdp2-resumed", 10)


@pytest.mark.multiprocess
@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_8bit_moments_of_whole_block_rows_step_their_fsdp2_shards(tmp_path, in_backward):
    """GaLore-8bit under FSDP2 on a model 256 wide: the embedding's and head's rows are whole
    256-entry quantisation blocks, so each rank steps and holds its own rows' 8-bit moments instead
    of one owner rank stepping the gathered matrix; in the optimizer's step and in per-parameter
    updates inside backward. Per-rank state equals the estimate exactly and sums to one process's,
    the run follows one process (8-bit codes amplify the ranks' other summation order, as in
    test_fsdp2's 8-bit cases), the checkpoint holds those moments as row shards, and a resume from
    it is exact."""
    wide = ModelShape(hidden=256, intermediate=512, heads=4, layers=2, kv_heads=2)
    wide.hf_config(VOCAB, 128).save_pretrained(tmp_path / "wide")
    common = [*COMMON, f"model.config={tmp_path / 'wide'}"]
    if in_backward:
        common += ["train.update_in_backward=true", "train.grad_clip=0"]
    run_worker_pair(WORKER, tmp_path, [json.dumps({"galore_8bit": ["fsdp2"]}), *common])
    one = json.loads((tmp_path / "galore_8bit-1p" / "summary.json").read_text())
    two = json.loads((tmp_path / "galore_8bit-fsdp2" / "summary.json").read_text())
    assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-2 * one["final_val_loss"]
    ranks = two["optimizer_state_bytes_per_rank"]
    assert ranks == two["estimated"]["optimizer_state_per_rank"]
    assert two["estimate_matches_measured"]["optimizer_state"]
    assert sum(ranks) == one["optimizer_state_bytes"], ranks
    # The embedding and the head (512 x 256 each, 8-bit) are split by rows: the checkpoint holds
    # their codes and scales as row shards (DTensors), not as an owner's whole tensors; the 1-D
    # norms stay whole on their owners.
    ckpt = tmp_path / "galore_8bit-fsdp2" / "checkpoints" / "step-20" / "trainer.pt"
    state = torch.load(ckpt, weights_only=True)["optimizer_skeleton"]["state"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        codes, scales = state[name]["exp_avg"], state[name]["exp_avg_sq_absmax"]
        assert codes["sharded"] and codes["dtype"] == "uint8" and codes["shape"] == [VOCAB, 256]
        assert scales["sharded"] and scales["shape"] == [VOCAB, 1]
    assert not state["model.norm.weight"]["exp_avg"]["sharded"]
    resumed, straight = final(tmp_path / "galore_8bit-fsdp2-resumed"), final(tmp_path / "galore_8bit-fsdp2")
    # Bitwise: the resumed run executes the same kernels in the same order as the straight one.
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)
    assert_resumed_from(tmp_path / "galore_8bit-fsdp2", tmp_path / "galore_8bit-fsdp2-resumed", 10)


@pytest.mark.run
def test_a_factorized_tied_qwen2_exports_and_reloads(configs, tmp_path):
    """Low-Rank surgery on a tied Qwen2, trained, merged and exported: transformers' own
    AutoModelForCausalLM reloads it (a Qwen2 with its head tied again) with the same logits; CoLA,
    whose factors are kept in a LLaMA-only class, is refused for it in one line."""
    from transformers import AutoModelForCausalLM

    from effpretrain.checkpoint import load_checkpoint, load_model_weights
    from effpretrain.export import export
    from effpretrain.run_model import build_run_model

    over = overrides(configs["qwen2_tied"], "train.max_steps=3", "train.eval_every=0", "factor.rank=8")
    cfg = load_config(TINY / "lowrank_restarts.yaml", over)
    train(cfg, tmp_path / "run")
    export(tmp_path / "run", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.lm_head.weight is hf.model.embed_tokens.weight
    path = tmp_path / "run" / "checkpoints" / "step-3"
    ours, _ = build_run_model(cfg, VOCAB)
    load_model_weights(ours, load_checkpoint(path)["model"], path)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(
            ours.eval()(input_ids=ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    train(load_config(TINY / "cola.yaml", over), tmp_path / "cola")
    with pytest.raises(
        ConfigError, match="FactoredLlamaForCausalLM, which builds LlamaForCausalLM models only"
    ):
        export(tmp_path / "cola", tmp_path / "hf_cola")


# ----------------------------------------------------------------------------------------------
# Presets and shapes


@pytest.mark.parametrize(
    "preset, params",
    [
        ("llama_7b", 6_738_415_616),  # Llama-2-7b
        ("llama_13b", 13_015_864_320),  # Llama-2-13b
        ("llama3_8b", 8_030_261_248),  # Meta-Llama-3-8B
        ("qwen2.5_0.5b", 494_032_768),  # Qwen2.5-0.5B (tied)
        ("mistral_7b", 7_241_732_096),  # Mistral-7B-v0.1
        ("qwen2.5_7b", 7_615_616_512),  # Qwen2.5-7B
    ],
)
def test_large_presets_have_the_parameter_counts_of_their_models(preset, params):
    config = build_llama_config(preset)
    with torch.device("meta"):
        model = build_model(config)
    assert sum(p.numel() for p in model.parameters()) == params
    assert memory.estimate(preset, "adamw").params == params
    assert shape_of(config) == PRESETS[preset]  # the shape round-trips through its HF config


def test_shape_of_reads_each_family(configs):
    from effpretrain.models.llama import load_hf_config

    for name, shape in FAMILIES.items():
        assert shape_of(load_hf_config(str(configs[name]))) == ModelShape(
            **{**shape.__dict__, "vocab": VOCAB}
        )
        assert shape_of(load_hf_config(str(configs[name] / "config.json"))).architecture == shape.architecture


def test_flops_count_kv_at_their_width_and_a_tied_head_once():
    """FLOPs/token (forward + backward: 3 x the forward's 2 per multiply-add) of a shape with
    grouped-query attention and a tied head, against a count by hand."""
    s = ModelShape(hidden=64, intermediate=160, heads=4, layers=2, vocab=512, kv_heads=2, tied=True)
    seq = 32
    q, kv = 4 * 16, 2 * 16
    linear = 64 * q + 2 * 64 * kv + q * 64 + 3 * 64 * 160  # q, k, v, o, gate/up/down per layer
    attention = 2 * seq * q  # multiply-adds per token per layer: scores (q.k) and values
    per_token = 6 * (2 * linear + 512 * 64) + 6 * 2 * attention  # 2 layers; the tied head once
    assert flops.flops_per_token(s, 512, seq) == per_token


# ----------------------------------------------------------------------------------------------
# Building layer by layer


def _units(model: torch.nn.Module) -> list[str]:
    """The units a build materializes, in order: the embedding, the decoder layers, the final norm,
    the head (unless it is the embedding)."""
    layers = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return ["model.embed_tokens", *layers, "model.norm", *([] if tied else ["lm_head"])]


@pytest.mark.parametrize("name", ["tiny", "llama_20m", *FAMILIES])
def test_a_layer_by_layer_build_equals_the_whole_build_bitwise(name):
    """The meta model materialized unit by unit holds the parameters and buffers of the whole
    build (``cls(config)`` after the seed), compared bitwise: the replay runs the same random
    operators on the same sizes in the same order (the dead ones on scratch tensors), so the
    generator draws the same numbers. Each unit already holds its final values when `after_layer`
    sees it; ties, dtypes, requires_grad, the non-persistent RoPE buffers and transformers'
    initialised flags come out the same; the global generator is left as it was."""
    config = build_llama_config(PRESETS.get(name) or FAMILIES[name], VOCAB, 128)
    rng = torch.get_rng_state()
    whole = build_model(config, seed=7, layerwise=False)
    seen = []

    def final_now(unit: str, module: torch.nn.Module) -> None:
        ref = dict(whole.get_submodule(unit).named_parameters())
        assert all(torch.equal(p, ref[n]) for n, p in module.named_parameters()), unit
        seen.append(unit)

    layered = build_model(config, seed=7, after_layer=final_now)
    assert torch.equal(rng, torch.get_rng_state())
    assert seen == _units(whole)
    for listing in ("named_parameters", "named_buffers"):
        a = list(getattr(whole, listing)(remove_duplicate=False))
        b = list(getattr(layered, listing)(remove_duplicate=False))
        assert [n for n, _ in a] == [n for n, _ in b]
        for (n, x), (_, y) in zip(a, b):
            assert type(x) is type(y) and x.dtype == y.dtype and x.requires_grad == y.requires_grad, n
            assert torch.equal(x, y), n
    rope = layered.model.rotary_emb
    assert {"inv_freq", "original_inv_freq"} <= rope._non_persistent_buffers_set
    assert rope.inv_freq.device.type == "cpu" and torch.equal(rope.inv_freq, whole.model.rotary_emb.inv_freq)
    tied = whole.lm_head.weight is whole.model.embed_tokens.weight
    assert (layered.lm_head.weight is layered.model.embed_tokens.weight) == tied
    assert tied == (name in ("qwen2_tied", "qwen3"))
    flags = [getattr(m, "_is_hf_initialized", False) for m in whole.modules()]
    assert flags == [getattr(m, "_is_hf_initialized", False) for m in layered.modules()] and all(flags)
    other = build_model(config, seed=8)  # the seed matters: equal values are not a constant's
    assert not torch.equal(
        other.model.layers[0].mlp.up_proj.weight, layered.model.layers[0].mlp.up_proj.weight
    )


def test_a_record_that_misses_a_tensor_is_refused():
    """A tensor the record does not initialise is refused by name, never left uninitialised."""
    from effpretrain.models.llama import model_class
    from effpretrain.models.materialize import materialize_, record_init

    config = FAMILIES["llama_gqa"].hf_config(VOCAB, 128)
    deeper = replace(FAMILIES["llama_gqa"], layers=3).hf_config(VOCAB, 128)
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(deeper)
    with pytest.raises(
        RuntimeError, match=r"no initialisation recorded for model\.layers\.2\.input_layernorm"
    ):
        materialize_(model, record_init(cls, config))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "1-byte"]
)
def test_a_layer_by_layer_build_holds_its_final_bytes_plus_one_layer(dtype):
    """Tensor accounting of a build whose `after_layer` converts each unit to `dtype` (float8
    stands in for INT8 weights: one byte a weight, as a quantizing `after_layer` will leave them):
    when a unit is final, the build holds exactly the units before it (converted) and this one in
    fp32, nothing of the units after it; its peak is at most the final bytes plus one decoder layer
    in fp32 (here the largest unit). Building whole and converting holds the fp32 model, more than
    that bound for bf16 and one byte (in fp32 both hold the final bytes: the whole build draws in
    place, the layer-by-layer one holds one scratch tensor at most while nothing else is held)."""
    from effpretrain.memory.accounting import accounting, tensor_bytes

    config = ModelShape(hidden=1024, intermediate=2816, heads=16, layers=4).hf_config(VOCAB, 128)
    done: list[int] = []  # each converted unit's bytes

    def convert(unit: str, module: torch.nn.Module) -> None:
        fp32 = tensor_bytes(module.parameters())
        held = sum(delta for sid, delta, _ in log.log if sid not in log.pre)  # allocated in the block
        assert held == sum(done) + fp32, unit
        module.to(dtype)
        done.append(tensor_bytes(module.parameters()))

    with accounting() as log:
        model = build_model(config, seed=0, after_layer=convert)
    peak = log.replay(include_existing=False)[0]
    final = tensor_bytes([*model.parameters(), *model.buffers()])
    assert all(p.dtype == dtype for p in model.parameters()) and sum(done) == tensor_bytes(model.parameters())
    layer = 4 * sum(p.numel() for p in model.model.layers[0].parameters())
    assert final <= peak <= final + layer, (peak, final, layer)
    if dtype != torch.float32:
        with accounting() as log:
            whole = build_model(config, seed=0, layerwise=False).to(dtype)
        assert log.replay(include_existing=False)[0] > final + layer
        assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), model.parameters()))


def test_the_run_model_is_built_layer_by_layer_in_its_precision():
    """A bf16-pure dense run's model is cast layer by layer as it is built, a factorized one's
    after its surgery (which creates its factors from fp32 weights); placed, each holds the
    parameters and buffers (RoPE's, which `place_model` casts with the rest) of the whole fp32
    build placed as before: an elementwise cast of the same values."""
    from effpretrain.run_model import build_run_model, place_model

    over = [*TINY_OVERRIDES, "train.precision=bf16-pure"]
    for recipe, built in (("adamw", torch.bfloat16), ("lowrank_restarts", torch.float32)):
        cfg = load_config(TINY / f"{recipe}.yaml", over)
        with torch.random.fork_rng(devices=[]):  # the surgery draws from the global generator
            torch.manual_seed(0)
            model, _ = build_run_model(cfg, VOCAB)
        assert {p.dtype for p in model.parameters()} == {built}, recipe
        whole = build_model("tiny", VOCAB, 32, seed=cfg.train.seed, layerwise=False)
        if cfg.factor.kind != "none":
            from effpretrain.models import apply_factorization

            f = cfg.factor
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                apply_factorization(whole, f.kind, f.rank, f.alpha, targets=tuple(f.targets), seed=f.seed)
        a = dict(place_model(model, cfg, "cpu", 0).state_dict(keep_vars=True))
        b = dict(place_model(whole, cfg, "cpu", 0).state_dict(keep_vars=True))
        a.update(model.named_buffers())
        b.update(whole.named_buffers())
        assert a.keys() == b.keys()
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a), recipe
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_the_committed_build_measurements_hold_the_bound_and_the_docs_quote_them():
    """benchmarks/results/model_build.json: each layer-by-layer build peaked (tensor accounting)
    at most at its final bytes plus its largest unit in fp32, each whole build above that; the
    table in docs/models.md quotes every row."""
    rows = json.loads((ROOT / "benchmarks" / "results" / "model_build.json").read_text())["rows"]
    doc = (ROOT / "docs" / "models.md").read_text()
    assert {r["path"] for r in rows} == {"layer_by_layer", "whole"}
    for r in rows:
        final, peak = r["final_bytes"], r["measured_peak_bytes"]
        if r["path"] == "layer_by_layer":
            assert final <= peak <= final + r["largest_unit_fp32_bytes"], r["model"]
        else:
            assert peak > final + r["largest_unit_fp32_bytes"], r["model"]
        how = "layer by layer" if r["path"] == "layer_by_layer" else "whole, then cast"
        gb = [f"{r[k] / 1e9:.2f} GB" for k in ("final_bytes", "measured_peak_bytes", "peak_rss_bytes")]
        assert f"| {r['model']} | {how} | {' | '.join(gb)} | {round(r['wall_s'])} s |" in doc, r["model"]


# ----------------------------------------------------------------------------------------------
# Bad configs


@pytest.mark.run
def test_bad_configs_are_refused_in_one_line(configs, tmp_path):
    gpt2 = tmp_path / "gpt2"
    import transformers

    transformers.GPT2Config(vocab_size=VOCAB, n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2)
    cases = {
        str(
            gpt2
        ): "model.config: model_type 'gpt2' is not supported; supported: LlamaForCausalLM, MistralForCausalLM",
        str(tmp_path / "missing"): "no such file or folder",
        str(tmp_path): "no config.json in this folder",
    }
    for source, needle in cases.items():
        with pytest.raises(ConfigError, match=needle):
            train(load_config(TINY / "adamw.yaml", overrides(Path(source))), tmp_path / "run")
    other_vocab = tmp_path / "other_vocab"
    FAMILIES["mistral"].hf_config(1000, 128).save_pretrained(other_vocab)
    with pytest.raises(ConfigError, match="vocab_size=1000 but the tokenizer has 512 tokens"):
        train(load_config(TINY / "adamw.yaml", overrides(other_vocab)), tmp_path / "run")
    with pytest.raises(
        ConfigError, match="data.seq_len=256 exceeds model.config's max_position_embeddings=128"
    ):
        train(
            load_config(TINY / "adamw.yaml", overrides(configs["qwen3"], "data.seq_len=256")),
            tmp_path / "run",
        )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_auto_checkpointing_plans_on_the_configs_layers(configs):
    """``activation_checkpointing: auto`` reads the model's own layers and shape: for the Qwen3
    config (2 layers, head size 32, q/k norms) a budget between the peaks with 1 and 0 layers
    checkpointed picks layer 0 only; below the all-layers peak nothing fits."""
    from effpretrain.memory import estimate_from_config, plan_checkpointing

    base = load_config(
        TINY / "adamw.yaml", overrides(configs["qwen3"], "data.seq_len=128", "train.batch_size=8")
    )
    peaks = [estimate_from_config(base, VOCAB, checkpointed=range(k)).peak for k in range(3)]
    assert peaks[0] > peaks[1] > peaks[2]
    budget = (peaks[0] + peaks[1]) / 2 / 1e9
    over = ["train.activation_checkpointing=auto", f"train.memory_budget_gb={budget}"]
    cfg = load_config(
        TINY / "adamw.yaml", overrides(configs["qwen3"], "data.seq_len=128", "train.batch_size=8", *over)
    )
    layers, est = plan_checkpointing(cfg, VOCAB)
    assert layers == [0] and est.peak == peaks[1]
    cfg.train.memory_budget_gb = peaks[2] / 2 / 1e9
    with pytest.raises(ConfigError, match="nothing fits; with every decoder layer checkpointed"):
        plan_checkpointing(cfg, VOCAB)
