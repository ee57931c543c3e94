"""A Llama-family decoder (Llama, Mistral, Qwen2) that reads and writes a paged KV cache.

One forward takes a packed batch of tokens from many sequences (prefills, prefill chunks and decodes
together, no padding) and returns logits only for the rows the caller asked for. Attention goes through
the kernels of `gpu_backend.ops`; everything else is plain torch. Parameters are created uninitialized:
the loader or a preset fills them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_backend.model_config import ModelConfig, resolve_dtype
from gpu_backend.model_input import AttentionMetadata
from gpu_backend.rope import RotaryEmbedding


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialized parameter: no time spent on an init that the checkpoint overwrites."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), with W stored [out, in] like torch and Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.weight = _empty((out_features, in_features), dtype, device)
        self.bias = _empty((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the projection."""
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight, as Llama does."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = _empty((hidden_size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with q/k/v fused into one projection."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias,
                               dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, dtype, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, backend) -> torch.Tensor:
        """Project, rotate, write this step's K/V into the cache, attend over the cache, project back."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = RotaryEmbedding.apply(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = RotaryEmbedding.apply(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # The host-side maxima go down with the call, so no kernel needs a device sync to size itself.
        if meta.is_decode_only:
            out = backend.decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale,
                                 max_context_len=meta.max_context_len, contiguous=meta.contiguous)
        else:
            out = backend.prefill(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                  meta.context_lens, self.scale, max_query_len=meta.max_q_len,
                                  contiguous=meta.contiguous)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused into one projection."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias,
                                   dtype, device)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block, each with a residual."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, backend) -> torch.Tensor:
        """One transformer layer over the packed tokens."""
        attn_out = self.self_attn(self.input_layernorm(hidden), cos, sin, k_cache, v_cache, meta, backend)
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class CausalLM(nn.Module):
    """The decoder plus LM head; `forward` maps a packed step to the logits the sampler needs."""

    def __init__(self, config: ModelConfig, dtype: str | torch.dtype | None = None,
                 device: torch.device | str = "cpu", backend=None):
        super().__init__()
        self.config = config
        dtype = resolve_dtype(dtype)
        self.embed_tokens = _empty((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = None if config.tie_word_embeddings else _empty((config.vocab_size, config.hidden_size),
                                                                        dtype, device)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device)
        self.attn_backend = backend

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of the KV cache the model expects)."""
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        """Device the weights live on."""
        return self.embed_tokens.device

    def set_backend(self, backend) -> None:
        """Choose the attention kernels (an object from `gpu_backend.ops.get_backend`)."""
        self.attn_backend = backend

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache) -> torch.Tensor:
        """Run one packed step; returns fp32 logits [len(logits_indices), vocab_size].

        Writes the K/V of every input token into `kv_cache` (a KVCache: .k[layer], .v[layer]) at
        attn_metadata.slot_mapping before attending, so a later step can read them.
        """
        if self.attn_backend is None:
            raise RuntimeError("CausalLM has no attention backend; call set_backend(get_backend(...)) first")
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer_idx, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, kv_cache.k[layer_idx], kv_cache.v[layer_idx], attn_metadata,
                           self.attn_backend)
        # The final norm is per token, so normalizing only the sampled rows is exact and cheaper.
        hidden = self.norm(hidden.index_select(0, attn_metadata.logits_indices))
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head).float()

    def hf_weight_sources(self) -> dict[str, list[tuple[str, int]]]:
        """For each parameter, the Hugging Face tensors stacked along dim 0 to fill it: (name, rows)."""
        cfg = self.config
        h, inter = cfg.hidden_size, cfg.intermediate_size
        q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        sources = {"embed_tokens": [("model.embed_tokens.weight", cfg.vocab_size)],
                   "norm.weight": [("model.norm.weight", h)]}
        if self.lm_head is not None:
            sources["lm_head"] = [("lm_head.weight", cfg.vocab_size)]
        for i in range(cfg.num_hidden_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            sources[ours + "input_layernorm.weight"] = [(hf + "input_layernorm.weight", h)]
            sources[ours + "post_attention_layernorm.weight"] = [(hf + "post_attention_layernorm.weight", h)]
            for kind in ["weight"] + (["bias"] if cfg.qkv_bias else []):
                sources[ours + f"self_attn.qkv_proj.{kind}"] = [
                    (hf + f"self_attn.q_proj.{kind}", q_rows), (hf + f"self_attn.k_proj.{kind}", kv_rows),
                    (hf + f"self_attn.v_proj.{kind}", kv_rows)]
            for kind in ["weight"] + (["bias"] if cfg.o_bias else []):
                sources[ours + f"self_attn.o_proj.{kind}"] = [(hf + f"self_attn.o_proj.{kind}", h)]
            for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
                sources[ours + f"mlp.gate_up_proj.{kind}"] = [(hf + f"mlp.gate_proj.{kind}", inter),
                                                              (hf + f"mlp.up_proj.{kind}", inter)]
                sources[ours + f"mlp.down_proj.{kind}"] = [(hf + f"mlp.down_proj.{kind}", h)]
        return sources
