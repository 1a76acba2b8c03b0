# A tiny Qwen3-architecture model for CPU runs and tests (python -m slime_search.models.tiny_qwen OUT --family qwen3
# builds its HF checkpoint offline). Source this file, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --swiglu
   --num-layers 2
   --hidden-size 64
   --ffn-hidden-size 128
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --kv-channels 32
   --qk-layernorm
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --max-position-embeddings 4096
   --vocab-size 151936
)
