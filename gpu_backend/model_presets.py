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
# weights are not Meta's) for GPU benchmarks.
ENGINE_PRESETS = ("tiny", "tiny-qwen2", "llama-1b-shape")
PRESETS: dict[str, ModelConfig] = {name: ModelConfig.from_spec(get_model(name)) for name in ENGINE_PRESETS}


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
