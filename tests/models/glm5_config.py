"""GLM-5's config.json fields (the published model), for tests that check configs, shapes and the
GLM-5-shaped slice (glm53.support.glm5_slice) against it."""

GLM5 = dict(
    model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
    moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64,
    q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    head_dim=192, index_n_heads=32, index_head_dim=128, index_topk=2048, n_routed_experts=256,
    num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, moe_layer_freq=1,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
    topk_method="noaux_tc", rope_parameters={"rope_theta": 1_000_000, "rope_type": "default"},
    max_position_embeddings=202752, rms_norm_eps=1e-5, eos_token_id=[154820, 154827, 154829],
    pad_token_id=154820, num_nextn_predict_layers=1, indexer_rope_interleave=True, rope_interleave=True,
)
