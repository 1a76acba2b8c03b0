# Qwen3-1.7B (config.json of Qwen/Qwen3-1.7B): Megatron model flags (slime's names). Source this file, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 2048
   --ffn-hidden-size 6144
   --num-attention-heads 16
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --qk-layernorm
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 151936
)
