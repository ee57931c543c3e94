"""A Llama- or Gemma-family decoder (Llama, Mistral, Qwen2, Gemma 2, Gemma 3 text) over a paged KV cache.

One forward takes a packed batch of tokens from many sequences (prefills, prefill chunks and decodes
together, no padding) and returns logits only for the rows the caller asked for. Attention goes through
the kernels of `gpu_backend.ops`, each layer with its own sliding window (None: full attention) and
logit soft-cap; everything else is plain torch. A layer reads its KV cache group's block table (one
table for all layers unless the metadata carries one per layer): a sliding layer's kernels skip the
blocks before its window, a full layer reads them all. Gemma adds
(1 + w) RMSNorms around attention and MLP, a GELU MLP, embeddings scaled by sqrt(hidden_size), and
(Gemma 3) per-head q/k norms and a separate RoPE base for sliding layers. Parameters are created
uninitialized: the loader or a preset fills them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_backend.model_config import ModelConfig, resolve_dtype
from gpu_backend.model_input import AttentionMetadata
from gpu_backend.ops.layer_ops import layer_ops
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

    gemma = False

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = _empty((hidden_size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as w - 1 and applied as (1 + w), in fp32 before the cast."""

    gemma = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


def _norm(config: ModelConfig, size: int, dtype: torch.dtype, device: torch.device | str) -> RMSNorm:
    """The architecture's RMSNorm over `size` features."""
    cls = GemmaRMSNorm if config.is_gemma else RMSNorm
    return cls(size, config.rms_norm_eps, dtype, device)


class Attention(nn.Module):
    """Grouped-query self-attention with q/k/v fused into one projection; one layer's window and soft-cap."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)  # None: full attention
        self.softcap = config.attn_logit_softcapping
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias,
                               dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, dtype, device)
        self.q_norm = _norm(config, self.head_dim, dtype, device) if config.qk_norm else None
        self.k_norm = _norm(config, self.head_dim, dtype, device) if config.qk_norm else None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, backend, ops) -> torch.Tensor:
        """Project, rotate, write this step's K/V into the cache, attend over the cache, project back."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rope(q, k, cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # The host-side maxima go down with the call, so no kernel needs a device sync to size itself.
        if meta.is_decode_only:
            out = backend.decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale,
                                 max_context_len=meta.max_context_len, contiguous=meta.contiguous,
                                 window=self.window, softcap=self.softcap)
        else:
            out = backend.prefill(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                  meta.context_lens, self.scale, max_query_len=meta.max_q_len,
                                  contiguous=meta.contiguous, window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GELU-tanh for Gemma) with gate and up fused into one projection."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias,
                                   dtype, device)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        """down(act(gate(x)) * up(x))."""
        return self.down_proj(ops.act_mul(self.gate_up_proj(x), self.gelu))


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block, each with a residual; Gemma also
    normalizes each block's output before its residual add (sandwich norms)."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = _norm(config, h, dtype, device)
        self.self_attn = Attention(config, layer, dtype, device)
        self.post_attention_layernorm = _norm(config, h, dtype, device)
        self.mlp = MLP(config, dtype, device)
        # Gemma: post_attention_layernorm closes the attention block, these open and close the MLP block.
        self.pre_feedforward_layernorm = _norm(config, h, dtype, device) if config.is_gemma else None
        self.post_feedforward_layernorm = _norm(config, h, dtype, device) if config.is_gemma else None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, backend, ops) -> torch.Tensor:
        """One transformer layer over the packed tokens (`ops`: layer_ops.py's norms, rotary, activation)."""
        x = ops.rms_norm(self.input_layernorm, hidden)
        attn_out = self.self_attn(x, cos, sin, k_cache, v_cache, meta, backend, ops)
        if self.pre_feedforward_layernorm is None:
            x, hidden = ops.add_rms_norm(self.post_attention_layernorm, attn_out, hidden)
            return hidden + self.mlp(x, ops)
        hidden = hidden + ops.rms_norm(self.post_attention_layernorm, attn_out)
        mlp_out = self.mlp(ops.rms_norm(self.pre_feedforward_layernorm, hidden), ops)
        return hidden + ops.rms_norm(self.post_feedforward_layernorm, mlp_out)


class CausalLM(nn.Module):
    """The decoder plus LM head; `forward` maps a packed step to the logits the sampler needs."""

    def __init__(self, config: ModelConfig, dtype: str | torch.dtype | None = None,
                 device: torch.device | str = "cpu", backend=None):
        super().__init__()
        self.config = config
        dtype = resolve_dtype(dtype)
        self.embed_tokens = _empty((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = _norm(config, config.hidden_size, dtype, device)
        self.lm_head = None if config.tie_word_embeddings else _empty((config.vocab_size, config.hidden_size),
                                                                        dtype, device)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device)
        # Gemma 3's sliding layers rotate with their own base and no scaling.
        self.local_rotary = (RotaryEmbedding(config.head_dim, config.rope_local_theta, None, device)
                             if config.rope_local_theta is not None else None)
        self.attn_backend = backend
        self.layer_ops = layer_ops(backend)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of the KV cache the model expects)."""
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        """Device the weights live on."""
        return self.embed_tokens.device

    def set_backend(self, backend) -> None:
        """Choose the attention kernels (an object from `gpu_backend.ops.get_backend`) and the layer ops that
        go with them."""
        self.attn_backend = backend
        self.layer_ops = layer_ops(backend)

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
        if self.config.is_gemma:  # the scale is rounded to the weights' dtype first, as transformers does
            hidden = hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        local = rope if self.local_rotary is None else self.local_rotary.cos_sin(positions, hidden.dtype)
        for layer_idx, layer in enumerate(self.layers):
            cos, sin = local if layer.self_attn.window is not None else rope
            hidden = layer(hidden, cos, sin, kv_cache.k[layer_idx], kv_cache.v[layer_idx],
                           attn_metadata.for_layer(layer_idx), self.attn_backend, self.layer_ops)
        # The final norm is per token, so normalizing only the sampled rows is exact and cheaper.
        hidden = self.layer_ops.rms_norm(self.norm, hidden.index_select(0, attn_metadata.logits_indices))
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = F.linear(hidden, head).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

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
            norms = ["input_layernorm", "post_attention_layernorm"]
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if cfg.is_gemma else []
            for norm in norms:
                sources[ours + f"{norm}.weight"] = [(hf + f"{norm}.weight", h)]
            if cfg.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    sources[ours + f"self_attn.{norm}.weight"] = [(hf + f"self_attn.{norm}.weight",
                                                                   cfg.head_dim)]
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
