"""Built-in model presets with seeded random weights, so demos, tests and benchmarks run without a checkpoint.

Random weights make text meaningless but exercise exactly the same shapes, kernels and memory as a real
checkpoint of that configuration: enough for throughput, memory and token-for-token parity checks.
"""
from __future__ import annotations

import torch

from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig, ModelLoadError, RopeScaling, resolve_dtype

PRESETS: dict[str, ModelConfig] = {
    # Llama with grouped-query attention (2 query heads per KV head), small enough for a 2-core CPU;
    # head_dim 64 because the Triton kernels support head_dim 64 and up.
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=256, intermediate_size=688,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=1, eos_token_ids=(2,), torch_dtype="float32",
    ),
    # Qwen2 flavour: q/k/v biases and tied embeddings.
    "tiny-qwen2": ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=1024, hidden_size=256, intermediate_size=688,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        qkv_bias=True, bos_token_id=1, eos_token_ids=(2,), torch_dtype="float32",
    ),
    # The shape of Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json), for GPU benchmarks.
    "llama-1b-shape": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,), torch_dtype="bfloat16",
    ),
}


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
    and logits spread enough that greedy choices are rarely near-ties. Norm weights are near 1.
    """
    generator = torch.Generator(device=model.device).manual_seed(int(seed))
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.normal_(1.0, 0.1, generator=generator)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1, generator=generator)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
