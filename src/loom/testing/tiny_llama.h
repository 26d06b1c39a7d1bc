// The tiny Llama 3 the unit and multi-rank tests build: the debugmodel flavor's settings at dim 64,
// 2 layers, 4 query heads sharing 2 key/value heads, SwiGLU hidden 192 (multiple_of 32, so every
// weight has a multiple of 32 rows), a vocabulary of 128 and a RoPE cache of 16 positions. A test
// that needs another shape changes fields of the result (and says why).
#pragma once
#include "loom/models/llama3/model_args.h"

namespace loom::testing {

inline llama3::ModelArgs tiny_llama_args() {
  llama3::ModelArgs a = llama3::flavor("debugmodel", 128);
  a.dim = 64;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.multiple_of = 32;
  a.max_seq_len = 16;
  return a;
}

}  // namespace loom::testing
