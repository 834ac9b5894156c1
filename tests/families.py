"""What today's open families switch on, as config choices of the one model (each imported and checked against
transformers in the test_convert* files), shared by the layout tests and the generation tests: Llama 3 RoPE scaling
past its original context, Qwen3's QK-norm and explicit head dim, tied embeddings, GQA, sliding windows in every
layer (Mistral) or interleaved with full layers and their own RoPE base (Gemma 3, with its post-norms, 1 + weight
norms, GeGLU, scaled embeddings, softmax scale, logit soft-capping and a single KV head), Qwen3-MoE's dense layers
among unnormalised top-k experts, and DeepSeek-V3's latent attention with grouped sigmoid routing, a shared
expert and a dense first layer."""
FAMILIES = {
    "llama3-qwen3-window": ["model.rope_scaling={rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, "
                            "high_freq_factor: 4.0, original_max_position_embeddings: 16}", "model.rope_theta=500000",
                            "model.qk_norm=true", "model.head_dim=48", "model.num_kv_heads=2",
                            "model.tie_embeddings=true", "model.sliding_window=16", "model.num_layers=2"],
    "gemma3": ["model.sliding_window=8", "model.local_rope_theta=1000",
               "model.layer_types=[sliding_attention, full_attention, sliding_attention]", "model.num_layers=3",
               "model.rope_scaling={rope_type: linear, factor: 2.0}", "model.post_norms=true",
               "model.norm_scale_offset=1.0", "model.activation=geglu", "model.scale_embeddings=true",
               "model.attention_scale=0.2", "model.final_logit_softcap=30.0", "model.qk_norm=true",
               "model.num_kv_heads=1", "model.tie_embeddings=true"],
    "deepseek-v3": ["model.mla={kv_lora_rank: 32, q_lora_rank: 48, qk_nope_head_dim: 16, qk_rope_head_dim: 8, "
                    "v_head_dim: 12}", "model.moe={num_experts: 8, top_k: 2, expert_ffn_size: 32, router: sigmoid, "
                    "num_groups: 4, top_groups: 2, routed_scaling_factor: 2.5, shared_experts: 1, "
                    "first_dense_layers: 1}", "model.num_layers=3"],
    "qwen3-moe": ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_size=64",
                  "model.moe.normalize_weights=false", "model.moe.dense_layers=[1]", "model.num_layers=3",
                  "model.qk_norm=true"],
}
