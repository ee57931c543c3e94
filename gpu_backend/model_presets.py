"""Registry models with seeded random weights, so demos, tests and benchmarks run without a checkpoint.

Random weights make text meaningless but exercise exactly the same shapes, kernels and memory as a real
checkpoint of that configuration: enough for throughput, memory and token-for-token parity checks.
"""
from __future__ import annotations

import torch

from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig, ModelLoadError, resolve_dtype
from simulator.core.models import get_model

# The registry entries the engine builds with random weights, by the name a replay takes: tiny and
# tiny-qwen2 for a 2-core CPU, llama-1b-shape (the registry's llama-3.2-1b, named for its shape because the
# weights are not Meta's) for GPU benchmarks. Their engine configs are the registry entries as they are.
REGISTRY_PRESETS = ("tiny", "tiny-qwen2", "llama-1b-shape")

# tiny's hybrid flavour, Gemma 3's layout at tiny's size: sliding-window layers (32 tokens, two blocks
# of 16) alternating with full-attention ones, q/k norms, a local RoPE base for the sliding layers and a
# final logit soft-cap. Its LM head is untied: with random weights, a tied head scaled by Gemma's
# sqrt(hidden) embedding mostly repeats the input token. The registry's entry of the same name carries
# its KV layout for the simulator and the capacity header; the fields here that it lacks leave KV alone.
TINY_HYBRID = ModelConfig(
    name="tiny-hybrid", architecture="Gemma3ForCausalLM", vocab_size=1024, hidden_size=256,
    intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_theta=10000.0,
    tie_word_embeddings=False, sliding_window=32,
    layer_types=("sliding_attention", "full_attention") * 2, hidden_act="gelu_pytorch_tanh",
    query_pre_attn_scalar=64.0, final_logit_softcapping=30.0, bos_token_id=2, eos_token_ids=(1,),
    torch_dtype="float32", num_params=3_429_120,
)

PRESETS: dict[str, ModelConfig] = {name: ModelConfig.from_spec(get_model(name)) for name in REGISTRY_PRESETS}
PRESETS[TINY_HYBRID.name] = TINY_HYBRID
# Every preset, TINY_HYBRID too: what `pagelab presets` and replay's --model help offer.
ENGINE_PRESETS = ("tiny", "tiny-qwen2", "tiny-hybrid", "llama-1b-shape")


def build_preset(name: str, dtype: str | torch.dtype | None = None, device: torch.device | str = "cpu",
                 backend=None, seed: int = 0) -> CausalLM:
    """A CausalLM of preset `name` with weights drawn from `seed` (same seed and device: same weights)."""
    if name not in PRESETS:
        raise ModelLoadError(f"unknown model preset {name!r}; expected one of {', '.join(sorted(PRESETS))}")
    config = PRESETS[name]
    model = CausalLM(config, dtype=resolve_dtype(dtype), device=device, backend=backend)
    init_random_weights(model, seed)
    return model


def init_random_weights(model: CausalLM, seed: int) -> None:
    """Fill all parameters from a generator on the model's device (so a 1B preset builds quickly on a GPU).

    Matrices get std 1/sqrt(fan_in): unit gain keeps activations in half-precision range at any width,
    and logits spread enough that greedy choices are rarely near-ties. Norm gains are near 1 (Gemma stores
    a gain as w - 1, so its weights are near 0).
    """
    generator = torch.Generator(device=model.device).manual_seed(int(seed))
    gain = 0.0 if model.config.is_gemma else 1.0
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.normal_(gain, 0.1, generator=generator)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1, generator=generator)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
