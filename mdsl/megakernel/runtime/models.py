"""The config.json values of the models the megakernel is measured on (their published shapes; the
weights of the tests and benchmarks are random)."""
from __future__ import annotations

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu", "eos_token_id": 151645,
}

QWEN3_8B = {
    **QWEN3_0_6B, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
}

MODELS = {"llama-3.2-1b": LLAMA_3_2_1B, "qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B}

# Qwen3-30B-A3B's shapes: 48 layers, each a mixture of 128 experts of which a token takes 8 (3.3B active parameters)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "eos_token_id": 151645,
}

# the models benchmarks/decode.py measures beside MODELS when asked (--models)
MOE_MODELS = {"qwen3-30b-a3b": QWEN3_30B_A3B}
