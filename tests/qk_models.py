"""Tiny transformers models (random weights, no downloads) for the QK-Clip tests."""

from __future__ import annotations

from typing import Any

import torch

SMALL = {"vocab_size": 64, "num_hidden_layers": 2, "bos_token_id": 0, "eos_token_id": 1}


def _configs() -> dict[str, Any]:
    import transformers as tf

    dense = {**SMALL, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    return {
        "llama_gqa": lambda: tf.LlamaConfig(**dense, num_key_value_heads=2),
        "qwen2_gqa_bias": lambda: tf.Qwen2Config(**dense, num_key_value_heads=2),
        "mistral_window": lambda: tf.MistralConfig(**dense, num_key_value_heads=1, sliding_window=4),
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=64,
            bos_token_id=0,
            eos_token_id=1,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**dense, attention_bias=True, rotary_pct=0.5),
        "phi3": lambda: tf.Phi3Config(**dense, num_key_value_heads=2, pad_token_id=0),
        "deepseek_v3_mla": lambda: tf.DeepseekV3Config(
            **dense,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=2,
            n_group=1,
            topk_group=1,
        ),
    }


MODELS = ("llama_gqa", "qwen2_gqa_bias", "mistral_window", "gpt2", "gpt_neox", "phi3", "deepseek_v3_mla")


def tiny_model(
    name: str, *, attn_implementation: str = "sdpa", seed: int = 0, gain: float = 1.0, layers: int = 2
) -> torch.nn.Module:
    """A tiny causal LM in train mode; ``gain`` multiplies the q/k-producing weights (large logits)."""
    import transformers as tf

    config = _configs()[name]()
    config._attn_implementation_internal = attn_implementation
    config.num_hidden_layers = layers
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    if gain != 1.0:
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if any(
                    k in pname
                    for k in ("q_proj", "k_proj", "c_attn", "query_key_value", "qkv_proj", "q_b_proj", "kv_b_proj")
                ):
                    p.mul_(gain)
    return model.train()
