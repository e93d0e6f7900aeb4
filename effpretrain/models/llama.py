"""Models of the LLaMA family: their shape (`ModelShape`), the presets, and building one from a
preset or from a HuggingFace config of a supported architecture (docs/benchmark.md)."""

from __future__ import annotations

import functools
import json
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from effpretrain.errors import ConfigError
from effpretrain.models.materialize import AfterLayer, build_layerwise

#: The architectures with the LLaMA layer layout (q/k/v/o, gate/up/down, RMSNorm), by their HF
#: class name, with their config's ``model_type``.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelShape:
    """What memory and FLOPs depend on in a model of the LLaMA family.

    Attributes:
        hidden, intermediate, heads, layers: width, MLP width, query heads, decoder layers.
        vocab: the vocabulary (a preset's is the paper's T5 tokenizer; the trainer uses the real
            tokenizer's size for a preset).
        kv_heads: key/value heads (grouped-query attention); 0: ``heads``.
        head_dim: per-head width; 0: ``hidden // heads``.
        tied: the head is the input embedding (one matrix).
        qkv_bias: attention's projections carry biases: q, k and v in Qwen2 (always), q, k, v and
            o in LLaMA and Qwen3 (their ``attention_bias``); never in Mistral, whose class has none.
        qk_norm: an RMSNorm over each head of q and k (Qwen3).
        rope_theta: RoPE's base.
        architecture: the HF class (`ARCHITECTURES`).
    """

    hidden: int
    intermediate: int
    heads: int
    layers: int
    vocab: int = 32000
    kv_heads: int = 0
    head_dim: int = 0
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        # One spelling per shape: the defaults stand for "as many KV heads as heads" and
        # "hidden // heads", so equal shapes compare equal however they were written.
        if self.kv_heads == self.heads:
            object.__setattr__(self, "kv_heads", 0)
        if self.head_dim * self.heads == self.hidden:
            object.__setattr__(self, "head_dim", 0)
        # What the architecture fixes: Qwen2's q/k/v carry biases, Mistral's attention none,
        # Qwen3 norms q and k.
        if self.architecture == "Qwen2ForCausalLM":
            object.__setattr__(self, "qkv_bias", True)
        if self.architecture == "MistralForCausalLM":
            object.__setattr__(self, "qkv_bias", False)
        if self.architecture == "Qwen3ForCausalLM":
            object.__setattr__(self, "qk_norm", True)

    @property
    def label(self) -> str:
        """A short name: the preset's if it has a preset's shape (any vocabulary), else its class
        and size."""
        name = next((n for n, shape in PRESETS.items() if replace(shape, vocab=self.vocab) == self), None)
        return name or f"{self.architecture} {self.layers} x {self.hidden}"

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of q (and of attention's output): heads x head_dim."""
        return self.heads * self.dim

    @property
    def kv_width(self) -> int:
        """Width of k and v: kv_heads x head_dim."""
        return self.kv * self.dim

    def hf_config(self, vocab_size: int | None = None, max_positions: int = 1024, **kw: Any) -> Any:
        """The transformers config of this shape (RMSNorm eps 1e-6, SiLU MLP, RoPE, SDPA).

        It states every field the shape holds, so that ``shape_of(shape.hf_config()) == shape``
        and the model it builds has the shape's parameters: a field left out takes the class's
        default, which need not be the shape's (Qwen3's ``head_dim`` is 128 whatever the width).
        """
        import transformers

        model_type = ARCHITECTURES[self.architecture]
        config_cls = transformers.AutoConfig.for_model(model_type).__class__
        extra: dict[str, Any] = {}
        if model_type in ("llama", "qwen3"):
            extra["attention_bias"] = self.qkv_bias
        if model_type == "llama":
            extra["mlp_bias"] = False
        if model_type in ("mistral", "qwen2", "qwen3"):
            extra["sliding_window"] = None
        return config_cls(
            vocab_size=vocab_size or self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv,
            head_dim=self.dim,
            num_hidden_layers=self.layers,
            max_position_embeddings=max_positions,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            initializer_range=0.02,
            tie_word_embeddings=self.tied,
            rope_theta=self.rope_theta,
            use_cache=False,
            attn_implementation="sdpa",
            architectures=[self.architecture],
            **extra,
            **kw,
        )


#: Kept for the name the presets had.
Preset = ModelShape

PRESETS: dict[str, ModelShape] = {
    # Trains in seconds on a laptop CPU; for tests and the quickstart.
    "tiny": ModelShape(hidden=128, intermediate=352, heads=4, layers=4, vocab=8192),
    "llama_20m": ModelShape(hidden=256, intermediate=688, heads=4, layers=4),
    "llama_60m": ModelShape(hidden=512, intermediate=1376, heads=8, layers=8),
    "llama_130m": ModelShape(hidden=768, intermediate=2048, heads=12, layers=12),
    "llama_350m": ModelShape(hidden=1024, intermediate=2736, heads=16, layers=24),
    "llama_1b": ModelShape(hidden=2048, intermediate=5461, heads=32, layers=24),
    # LLaMA-2-7B (GaLore's 7B; Touvron et al. 2023, Table 1 and its config.json).
    "llama_7b": ModelShape(hidden=4096, intermediate=11008, heads=32, layers=32),
    # LLaMA-2-13B (its config.json; LLaMA-1's 13B has the same shape: Touvron et al. 2023, Table 2).
    "llama_13b": ModelShape(hidden=5120, intermediate=13824, heads=40, layers=40),
    # Llama-3-8B (Meta's config.json): grouped-query attention, a 128,256 vocabulary.
    "llama3_8b": ModelShape(
        hidden=4096, intermediate=14336, heads=32, layers=32, vocab=128256, kv_heads=8, rope_theta=500000.0
    ),
    # Mistral-7B-v0.1 (its config.json): grouped-query attention; its 4096-token sliding window
    # plays no part at the sequence lengths trained here.
    "mistral_7b": ModelShape(
        hidden=4096,
        intermediate=14336,
        heads=32,
        layers=32,
        kv_heads=8,
        architecture="MistralForCausalLM",
    ),
    # Qwen2.5-7B (Qwen's config.json): untied, q/k/v biases, 4 KV heads, a padded 152,064 vocabulary.
    "qwen2.5_7b": ModelShape(
        hidden=3584,
        intermediate=18944,
        heads=28,
        layers=28,
        vocab=152064,
        kv_heads=4,
        qkv_bias=True,
        rope_theta=1000000.0,
        architecture="Qwen2ForCausalLM",
    ),
    # Qwen2.5-0.5B's shape (Qwen's config.json): tied embeddings, q/k/v biases, 2 KV heads.
    "qwen2.5_0.5b": ModelShape(
        hidden=896,
        intermediate=4864,
        heads=14,
        layers=24,
        vocab=151936,
        kv_heads=2,
        tied=True,
        qkv_bias=True,
        rope_theta=1000000.0,
        architecture="Qwen2ForCausalLM",
    ),
}


#: Published models whose shape is a preset's, by hub id: `model.init` naming one has its shape
#: without a download (`effpretrain estimate` offline); training still reads the model's own
#: config.json, and its weights must match it tensor by tensor.
HUB_SHAPES: dict[str, str] = {
    "meta-llama/Llama-3.1-8B": "llama3_8b",
    "mistralai/Mistral-7B-v0.1": "mistral_7b",
    "Qwen/Qwen2.5-7B": "qwen2.5_7b",
}


def shape_of(config: Any) -> ModelShape:
    """The `ModelShape` of a transformers config of a supported architecture.

    Raises:
        ValueError: the architecture is not one of `ARCHITECTURES` (naming them).
    """
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs:
        arch = next((a for a, t in ARCHITECTURES.items() if t == model_type), None)
    if arch is None or ARCHITECTURES[arch] != model_type:
        found = ", ".join(archs) or f"model_type {model_type!r}"
        raise ValueError(f"{found} is not supported; supported: {', '.join(ARCHITECTURES)}")
    # Only LlamaForCausalLM reads mlp_bias; the other classes build a bias-free MLP whatever it says.
    if model_type == "llama" and getattr(config, "mlp_bias", False):
        raise ValueError(f"{arch} with mlp_bias=true is not supported (the MLP is bias-free in this family)")
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return ModelShape(
        hidden=int(config.hidden_size),
        intermediate=int(config.intermediate_size),
        heads=heads,
        layers=int(config.num_hidden_layers),
        vocab=int(config.vocab_size),
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        # LLaMA and Qwen3 read attention_bias; Qwen2 always has q/k/v biases, Mistral none (ModelShape).
        qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        qk_norm=model_type == "qwen3",
        rope_theta=_rope_theta(config),
        architecture=arch,
    )


def _rope_theta(config: Any) -> float:
    """RoPE's base: ``rope_parameters["rope_theta"]`` (transformers 5) or ``rope_theta``."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(config, "rope_theta", None) or 10000.0)


def load_hf_config(source: str) -> Any:
    """A transformers config from `source`: a ``config.json`` file, a folder holding one, or a
    hub id (where the network is reachable).

    Raises:
        ValueError: the file or folder is missing or unreadable, or the hub has no such model.
    """
    import transformers

    path = Path(source).expanduser()
    try:
        if path.is_file():
            d = json.loads(path.read_text())
            return transformers.AutoConfig.for_model(**d)
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(f"{source}: no config.json in this folder")
        if not path.exists() and (source.startswith(("/", ".", "~")) or path.suffix == ".json"):
            raise ValueError(f"{source}: no such file or folder")
        return transformers.AutoConfig.from_pretrained(str(path) if path.is_dir() else source)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{source}: cannot read a model config ({first})") from None


@functools.lru_cache(maxsize=16)
def _config_shape(source: str) -> ModelShape:
    return shape_of(load_hf_config(source))


def model_shape(model_cfg: Any) -> ModelShape:
    """The shape a run's ``model`` section describes: ``model.init``'s or ``model.config``'s
    (loaded once per source), or ``model.preset``'s.

    Raises:
        ConfigError: the config cannot be read or is not a supported architecture.
    """
    key, source = config_source(model_cfg)
    if key == "model.init" and source in HUB_SHAPES and not Path(source).expanduser().exists():
        return PRESETS[HUB_SHAPES[source]]
    if source:
        try:
            return _config_shape(config_location(model_cfg))
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    return PRESETS[model_cfg.preset]


def config_source(model_cfg: Any) -> tuple[str, str]:
    """(the key, its value) of the run's model config: ``model.init``'s (its folder's
    config.json), ``model.config``, or ("", "") for a preset."""
    if getattr(model_cfg, "init", ""):
        return "model.init", model_cfg.init
    if getattr(model_cfg, "config", ""):
        return "model.config", model_cfg.config
    return "", ""


def config_location(model_cfg: Any) -> str:
    """Where the run's model config is read (`load_hf_config`): ``model.config`` as given, or
    ``model.init``'s local folder (a hub id's download, `resolve_init`)."""
    key, source = config_source(model_cfg)
    return str(resolve_init(source)) if key == "model.init" else source


#: The files a hub download of ``model.init`` fetches: the config, the weights, the tokenizer.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def resolve_init(source: str) -> Path:
    """The local folder of `model.init`: the folder itself, or a hub id's download (config,
    safetensors weights and tokenizer files only)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConfigError(
            f"model.init: {source} is a file; give the model's folder (config.json and weights)"
        )
    if source.startswith(("/", ".", "~")) or source.count("/") != 1:
        raise ConfigError(f"model.init: {source}: no such folder")
    return _hub_folder(source)


@functools.lru_cache(maxsize=16)
def _hub_folder(repo_id: str) -> Path:
    """A hub model's download (`_HUB_PATTERNS`), once per process: the shape, the config and the
    weights each ask for the folder."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline, unknown id, gated model: one line, whatever the hub's error
        raise ConfigError(f"model.init: cannot fetch {repo_id!r} from the hub ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def init_folder_for_tokenizer(source: str) -> str | None:
    """The tokenizer `data.tokenizer: auto` means for `model.init` = `source`: the folder, when it
    holds one, or the hub id itself (resolved when the tokenizer loads); None for a local folder
    without one."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # what transformers loads
        return source if any((path / f).is_file() for f in files) else None
    return source if not path.exists() else None


def model_label(model_cfg: Any) -> str:
    """A run's model by name: ``model.preset``, or ``model.config``'s folder (or file stem, or hub
    id's last part), a name that fits a run directory."""
    source = config_source(model_cfg)[1]
    if not source:
        return model_cfg.preset
    path = Path(source)
    if path.suffix == ".json":
        return path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return path.name


def resolve_shape(preset_or_shape: str | ModelShape) -> ModelShape:
    """A preset's shape by name, or the shape itself."""
    return PRESETS[preset_or_shape] if isinstance(preset_or_shape, str) else preset_or_shape


def build_llama_config(
    preset: str | ModelShape, vocab_size: int | None = None, max_positions: int = 1024, **kw
):
    """The transformers config of a preset (or shape): RMSNorm eps 1e-6, SiLU MLP, RoPE."""
    return resolve_shape(preset).hf_config(vocab_size, max_positions, **kw)


def model_class(config: Any) -> type:
    """The transformers class that builds `config` (`ARCHITECTURES`)."""
    import transformers

    return getattr(transformers, shape_of(config).architecture)


def build_model(
    preset: str | ModelShape | Any,
    vocab_size: int | None = None,
    max_positions: int = 1024,
    seed: int = 0,
    *,
    after_layer: AfterLayer | None = None,
    layerwise: bool = True,
):
    """Builds a freshly initialised model (fp32) deterministically from `seed`: a preset or shape
    (its config at `vocab_size` and `max_positions`), or a transformers config of a supported
    architecture as it is.

    The values are those of ``cls(config)`` after ``torch.manual_seed(seed)``. By default the model
    is created on the meta device and materialized one unit (decoder layer, embedding, norm, head)
    at a time with those values bit for bit (`effpretrain.models.materialize`), running
    `after_layer` on each unit once it is final; `layerwise` False builds it whole, as transformers
    does (the reference the layer-by-layer build is tested against). Under a ``torch.device("meta")``
    context it builds on the meta device, allocating nothing.
    """
    if isinstance(preset, (str, ModelShape)):
        cfg = build_llama_config(preset, vocab_size, max_positions)
    else:
        cfg = preset
    cls = model_class(cfg)
    if torch.empty(0).device.type == "meta":
        return cls(cfg)
    if layerwise:
        return build_layerwise(cls, cfg, seed, after_layer)
    if after_layer is not None:
        raise ValueError("build_model: after_layer needs layerwise=True")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(cfg)


def set_activation_checkpointing(model: torch.nn.Module, every: int | Collection[int]) -> int:
    """Checkpoints every `every`-th decoder layer (0 disables), or the layers whose indices
    `every` lists; returns how many layers are.

    Works on transformers' GradientCheckpointingLayer blocks directly, so "every k layers"
    does not depend on the transformers version's own enabling API.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    fn = functools.partial(checkpoint, use_reentrant=False)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    chosen = set(range(0, len(layers), every) if every > 0 else ()) if isinstance(every, int) else set(every)
    count = 0
    for i, layer in enumerate(layers):
        on = i in chosen
        layer.gradient_checkpointing = on
        layer._gradient_checkpointing_func = fn
        count += on
    return count
