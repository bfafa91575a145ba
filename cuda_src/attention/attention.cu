// Attention family, unit 1 of 2: paged KV-cache writes, split-KV decode (tensor cores for f16/bf16
// caches up to head_dim 256, SIMT otherwise) and the merge of partial states (memory-bound). The
// tensor-core prefill lives in prefill.cu, a unit of its own so that each compiles in a few seconds.
// See cukern/attention.py.
#include "attention/kv_write.cuh"
#include "attention/decode.cuh"
#include "attention/decode_tc.cuh"
#include "attention/merge.cuh"
