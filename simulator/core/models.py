"""The model registry: every model shape the simulator and the engine know, in Hugging Face's field names.

One frozen `ModelSpec` per model holds the fields of its config.json plus what memory and FLOP arithmetic
needs (the exact parameter count, a context cap); `MODELS` maps each entry's name to it and `get_model`
also accepts an entry's aliases and Hugging Face id (in any letter case), and a local checkpoint folder,
whose config.json it reads for the shape (nothing is downloaded). The simulator sizes KV pools and prices
steps from these entries (simulator/presets.py, simulator/timing/step_latency.py); the engine runs them as
its `ModelConfig` (gpu_backend/model_config.py), some with seeded random weights
(gpu_backend/model_presets.py). Nothing here imports torch or numpy.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.core.errors import ConfigError

# Bytes per element of the dtypes config.json's torch_dtype names.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
# A config that names no dtype is served in bf16 (what the engine runs such a checkpoint in on a GPU).
DEFAULT_DTYPE = "bfloat16"

# config.json's layer_types values known here (vLLM: Full/SlidingWindow/ChunkedLocalAttentionSpec).
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """The `rope_scaling` block of a config: how rotary frequencies are stretched for long contexts."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer: its config.json fields, its parameter count and its serving limits
    (the simulator's short names and byte counts are properties)."""

    name: str = ""  # the registry key; empty for a config read from a checkpoint folder
    aliases: tuple[str, ...] = ()  # further names get_model accepts for this entry
    hf_id: str | None = None  # the Hugging Face repository whose config.json the numbers are
    architecture: str  # config.json's architectures[0]
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # OPT's config.json calls it ffn_dim
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias=true
    o_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj, Qwen2's does not
    mlp_bias: bool = False
    # Per-layer attention, config.json's layer_types; None: every layer attends fully, and a sliding_window
    # then only caps the length (see max_model_len).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # the window of the sliding_attention layers
    attention_chunk_size: int | None = None  # the chunk of the chunked_attention layers (Llama 4)
    kv_lora_rank: int | None = None  # MLA (DeepSeek V2/V3): the latent cached per token and layer
    qk_rope_head_dim: int | None = None  # MLA: the RoPE key part cached beside the latent
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's dtype, which the simulator serves it in
    num_params: int | None = None  # the checkpoint's exact parameter count; None where nobody counted
    context_limit: int | None = None  # a cap below max_position_embeddings that the model card sets

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            _check_positive(name, getattr(self, name))
        for name in ("num_params", "context_limit"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        _check_layer_kv(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def names(self) -> tuple[str, ...]:
        """Every name get_model finds this entry by: its own, then its aliases."""
        return (self.name, *self.aliases)

    @property
    def num_layers(self) -> int:
        """num_hidden_layers."""
        return self.num_hidden_layers

    @property
    def num_heads(self) -> int:
        """num_attention_heads (query heads)."""
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        """num_key_value_heads."""
        return self.num_key_value_heads

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def max_model_len(self) -> int:
        """The longest sequence served unless a run asks for less: max_position_embeddings, capped by
        context_limit, and by sliding_window when no layer_types say which layers slide (such a model is
        served with full attention, which equals sliding-window attention only while the sequence fits)."""
        caps = (self.max_position_embeddings, self.context_limit,
                self.sliding_window if self.layer_types is None else None)
        return min(c for c in caps if c)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per weight and per KV element in the serving dtype (torch_dtype; bf16 when unnamed)."""
        dtype = self.torch_dtype or DEFAULT_DTYPE
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"{self.name or 'model'}: torch_dtype {dtype!r} has no known size; "
                              f"expected one of {', '.join(DTYPE_BYTES)}")
        return DTYPE_BYTES[dtype]

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Each layer's attention, in layer_types' words (all full_attention when layer_types is None)."""
        return self.layer_types or ("full_attention",) * self.num_hidden_layers

    @property
    def is_mla(self) -> bool:
        """Whether layers cache one compressed latent per token (MLA) instead of K and V per KV head."""
        return self.kv_lora_rank is not None

    @property
    def kv_elements_per_layer(self) -> int:
        """Elements one token caches in one layer: the latent plus RoPE key under MLA (vLLM's
        MLAAttentionSpec: one head of kv_lora_rank + qk_rope_head_dim), else K and V of every KV head."""
        if self.kv_lora_rank is not None and self.qk_rope_head_dim is not None:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: Any = None) -> int:
        """Bytes of KV one token occupies over all layers, in `dtype` (anything with an itemsize, such as a
        torch dtype; None: the serving dtype)."""
        itemsize = self.dtype_bytes if dtype is None else int(dtype.itemsize)
        return self.num_hidden_layers * self.kv_elements_per_layer * itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers in the serving dtype."""
        return self.kv_bytes_per_token()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights in the serving dtype."""
        if self.num_params is None:
            raise ConfigError(f"{self.name or 'model'}: num_params is unknown, so are its weight bytes")
        return self.num_params * self.dtype_bytes

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_layer_kv(m: ModelSpec) -> None:
    """Refuse per-layer attention fields that contradict each other."""
    for name in ("sliding_window", "attention_chunk_size", "kv_lora_rank", "qk_rope_head_dim"):
        if getattr(m, name) is not None:
            _check_positive(name, getattr(m, name))
    if (m.kv_lora_rank is None) != (m.qk_rope_head_dim is None):
        raise ConfigError("MLA needs both kv_lora_rank and qk_rope_head_dim")
    if m.layer_types is None:
        return
    if len(m.layer_types) != m.num_hidden_layers:
        raise ConfigError(f"layer_types has {len(m.layer_types)} entries for {m.num_hidden_layers} layers")
    unknown = sorted(set(m.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types: unknown {', '.join(map(repr, unknown))}; "
                          f"expected {', '.join(LAYER_TYPES)}")
    needs = (("sliding_attention", "sliding_window"), ("chunked_attention", "attention_chunk_size"))
    for kind, field in needs:
        if kind in m.layer_types and getattr(m, field) is None:
            raise ConfigError(f"layer_types has {kind} layers but {field} is not set")


def _check_positive(name: str, value: Any) -> None:
    """Refuse a count that is not a positive integer (bools are not counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")


def _every(period: int, kind: str, others: str, num_layers: int) -> tuple[str, ...]:
    """layer_types of a model whose every `period`-th layer is `kind` and every other one `others`."""
    return tuple(kind if (i + 1) % period == 0 else others for i in range(num_layers))


# Each entry is the named checkpoint's config.json (head_dim where it omits it: hidden_size / heads);
# num_params is its exact parameter count (tests/simulator/core/test_models.py recomputes it).
# gpt-oss: MoE layers alternating a 128-token window with full attention; experts ship in MXFP4, so
# num_params x 2 is not their weight size: it stays unknown (plan their pool with --kv-memory-gb).
_GPT_OSS_20B = ModelSpec(
    name="gpt-oss-20b", hf_id="openai/gpt-oss-20b", architecture="GptOssForCausalLM", vocab_size=201088,
    hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=150000.0, rope_scaling=RopeScaling(rope_type="yarn", factor=32.0,
                                                   original_max_position_embeddings=4096),
    qkv_bias=True, o_bias=True, layer_types=_every(2, "full_attention", "sliding_attention", 24),
    sliding_window=128, eos_token_ids=(200002,), torch_dtype="bfloat16",
)

MODELS: dict[str, ModelSpec] = {
    # MHA, learned positions, biases everywhere, LayerNorm, ReLU, tied LM head.
    "opt-13b": ModelSpec(
        name="opt-13b", hf_id="facebook/opt-13b", architecture="OPTForCausalLM", vocab_size=50272,
        hidden_size=5120, intermediate_size=20480, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=40, head_dim=128, max_position_embeddings=2048, tie_word_embeddings=True,
        qkv_bias=True, o_bias=True, mlp_bias=True, bos_token_id=2, eos_token_ids=(2,), torch_dtype="float16",
        num_params=12_853_473_280,
    ),
    # MHA, untied LM head.
    "llama-2-7b": ModelSpec(
        name="llama-2-7b", aliases=("meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b"),
        hf_id="meta-llama/Llama-2-7b-hf", architecture="LlamaForCausalLM", num_params=6_738_415_616,
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_ids=(2,), torch_dtype="float16",
    ),
    # GQA with 8 KV heads, untied LM head.
    "llama-3-8b": ModelSpec(
        name="llama-3-8b", aliases=("meta-llama/Meta-Llama-3-8B-Instruct",),
        hf_id="meta-llama/Meta-Llama-3-8B", architecture="LlamaForCausalLM",
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000, eos_token_ids=(128001,),
        torch_dtype="bfloat16", num_params=8_030_261_248,
    ),
    # GQA with 4 KV heads, QKV biases, untied LM head. config.json allows 131,072 positions, but the model
    # card says beyond 32,768 needs YaRN scaling, so serving stops at 32,768.
    "qwen2.5-7b": ModelSpec(
        name="qwen2.5-7b", aliases=("Qwen/Qwen2.5-7B-Instruct",), hf_id="Qwen/Qwen2.5-7B",
        architecture="Qwen2ForCausalLM", vocab_size=152064,
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1000000.0, qkv_bias=True, bos_token_id=151643, eos_token_ids=(151643,),
        torch_dtype="bfloat16", num_params=7_615_616_512, context_limit=32768,
    ),
    # GQA with 8 KV heads of dim 64, Llama 3 RoPE scaling, tied LM head; small enough for GPU runs. The
    # engine builds it with random weights under the name llama-1b-shape (the shape, not the checkpoint),
    # which replays record, so fitted profiles and run folders name it either way.
    "llama-3.2-1b": ModelSpec(
        name="llama-3.2-1b", aliases=("llama-1b-shape", "meta-llama/Llama-3.2-1B-Instruct"),
        hf_id="meta-llama/Llama-3.2-1B",
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, num_params=1_235_814_400,
        rope_scaling=RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,), torch_dtype="bfloat16",
    ),
    # The engine's CPU model: Llama with grouped-query attention (2 query heads per KV head), small enough
    # for a 2-core CPU, in fp32 (half precision is slow there); head_dim 64 because the Triton kernels
    # support head_dim 64 and up. Simulations of its CPU replays use the fitted profile cpu-tiny.
    "tiny": ModelSpec(
        name="tiny", architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=256, intermediate_size=688,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
        eos_token_ids=(2,), torch_dtype="float32", num_params=3_426_560,
    ),
    # tiny's Qwen2 flavour: q/k/v biases and tied embeddings.
    "tiny-qwen2": ModelSpec(
        name="tiny-qwen2", architecture="Qwen2ForCausalLM", vocab_size=1024, hidden_size=256,
        intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        qkv_bias=True, bos_token_id=1, eos_token_ids=(2,), torch_dtype="float32", num_params=3_166_464,
    ),
    # tiny's hybrid flavour, Gemma 3's layout (32-token windows); the engine's preset adds what leaves KV
    # alone (its norms, local RoPE base, soft-cap: gpu_backend/model_presets.py).
    "tiny-hybrid": ModelSpec(
        name="tiny-hybrid", architecture="Gemma3ForCausalLM", vocab_size=1024, hidden_size=256,
        intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, layer_types=("sliding_attention", "full_attention") * 2,
        sliding_window=32, bos_token_id=2, eos_token_ids=(1,), torch_dtype="float32", num_params=3_429_120),
    # Served today, each hf_id's config.json (Gemma 3: its text_config). Llama 3.1: GQA, 128k positions.
    "llama-3.1-8b": ModelSpec(
        name="llama-3.1-8b", aliases=("meta-llama/Llama-3.1-8B-Instruct",), hf_id="meta-llama/Llama-3.1-8B",
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_ids=(128001,), torch_dtype="bfloat16", num_params=8_030_261_248,
    ),
    # Mistral 7B v0.1: a 4096-token sliding window on every layer (transformers' MistralAttention).
    "mistral-7b-v0.1": ModelSpec(
        name="mistral-7b-v0.1", hf_id="mistralai/Mistral-7B-v0.1", architecture="MistralForCausalLM",
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-5, layer_types=("sliding_attention",) * 32, sliding_window=4096,
        bos_token_id=1, eos_token_ids=(2,), torch_dtype="bfloat16", num_params=7_241_732_096,
    ),
    # Qwen3 32B: GQA with RMSNorm on queries and keys, no biases.
    "qwen3-32b": ModelSpec(
        name="qwen3-32b", hf_id="Qwen/Qwen3-32B", architecture="Qwen3ForCausalLM", vocab_size=151936,
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, bos_token_id=151643, eos_token_ids=(151645,), torch_dtype="bfloat16",
        num_params=32_762_123_264,
    ),
    # Gemma 3 27B's text decoder: five 1024-token sliding-window layers, then one global layer
    # (sliding_window_pattern 6); the count is the text model's (the vision tower is not served here).
    "gemma-3-27b": ModelSpec(
        name="gemma-3-27b", hf_id="google/gemma-3-27b-it", architecture="Gemma3ForCausalLM",
        vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=RopeScaling(rope_type="linear", factor=8.0),
        tie_word_embeddings=True, layer_types=_every(6, "full_attention", "sliding_attention", 62),
        sliding_window=1024, bos_token_id=2, eos_token_ids=(1, 106), torch_dtype="bfloat16",
        num_params=27_009_346_304,
    ),
    "gpt-oss-20b": _GPT_OSS_20B,
    # gpt-oss-120b: the 20B's layer shape, 36 layers deep (more experts per layer: same KV per layer).
    "gpt-oss-120b": _GPT_OSS_20B.replace(name="gpt-oss-120b", hf_id="openai/gpt-oss-120b",
                                         num_hidden_layers=36,
                                         layer_types=_every(2, "full_attention", "sliding_attention", 36)),
    # DeepSeek V3: MLA caches a 512-wide latent plus a 64-wide RoPE key per token and layer; head_dim is
    # the query/key head (128 + 64). FP8 weights: num_params stays unknown.
    "deepseek-v3": ModelSpec(
        name="deepseek-v3", hf_id="deepseek-ai/DeepSeek-V3", architecture="DeepseekV3ForCausalLM",
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, head_dim=192, max_position_embeddings=163840,
        rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=RopeScaling(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096),
        kv_lora_rank=512, qk_rope_head_dim=64, bos_token_id=0, eos_token_ids=(1,), torch_dtype="bfloat16",
    ),
}

# Alias -> entry, derived from the entries themselves so that an alias lives in exactly one place.
_BY_ALIAS: dict[str, ModelSpec] = {alias: spec for spec in MODELS.values() for alias in spec.aliases}
# Every name, alias and Hugging Face id in lower case: ids are typed as the hub spells them, or not.
_BY_FOLDED: dict[str, ModelSpec] = {n.casefold(): spec for spec in MODELS.values()
                                    for n in (*spec.names, *((spec.hf_id,) if spec.hf_id else ()))}


def model_names() -> list[str]:
    """Every name get_model accepts, entries' own names and aliases, sorted."""
    return sorted([*MODELS, *_BY_ALIAS])


def _registered(name: str) -> ModelSpec | None:
    """The registry entry `name` names (own name, alias or Hugging Face id, any case), or None."""
    return MODELS.get(name) or _BY_ALIAS.get(name) or _BY_FOLDED.get(name.casefold())


def get_model(name: str) -> ModelSpec:
    """Look up a model by its name, an alias or Hugging Face id, or read a local checkpoint folder."""
    spec = _registered(name)
    if spec is not None:
        return spec
    if name and Path(name).is_dir():  # a checkpoint folder, even one without its config.json (said as such)
        return _read_folder(str(Path(name).resolve()), name)
    if name and Path(name).is_file():
        raise ConfigError(f"{name} is a file: give the folder that holds a model's config.json, or a name")
    raise ConfigError(f"unknown model {name!r}; valid models: {', '.join(model_names())}, the Hugging Face "
                      "id of one (see `pagelab presets`), or a local folder with a config.json")


def canonical_name(name: str) -> str:
    """The registry's own name for `name` (itself, or the entry it is an alias of); other names unchanged."""
    spec = _registered(name)
    return name if spec is None else spec.name


@functools.lru_cache(maxsize=16)
def _read_folder(path: str, shown: str) -> ModelSpec:
    """The shape in `path`/config.json (read once per process), its parameter count estimated."""
    from simulator.core.model_files import estimate_params, read_config

    fields, raw, file = read_config(path)
    try:
        spec = ModelSpec(name=shown, **fields)
    except ConfigError as exc:
        raise ConfigError(exc.args[0] if str(exc).startswith(file) else f"{file}: {exc}") from None
    return spec.replace(num_params=estimate_params(spec, raw))
