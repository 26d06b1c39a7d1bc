#include "loom/models/config.h"

#include "loom/models/spec.h"

namespace loom::models {

namespace {
void check(const ModelConfig& m) {
  const options::Section& s = model_section();
  options::require(m.vocab_size >= 0, s, "vocab_size", ">= 0", &m);
  options::require(m.n_layers >= 0, s, "n_layers", ">= 0 (0 = the flavor's)", &m);
}
}  // namespace

const options::Section& model_section() {
  using S = ModelConfig;
  static const options::Section section{
      "model",
      {
          {LOOM_OPTION(S, name), "Model family to train.", spec_names()},
          {LOOM_OPTION(S, flavor),
           "Size within the family: `debugmodel`, `8B`, `70B`, `405B`, ... (the family's list of "
           "flavors decides what is valid)."},
          {LOOM_OPTION(S, tokenizer_path),
           "Hugging Face `tokenizer.json` (byte-level BPE). `make train` creates the default one from"
           " the bundled corpus."},
          {LOOM_OPTION(S, vocab_size),
           "Rows of the token embedding and output projection; `0` = the tokenizer's vocabulary size."
           " A larger value pads the vocabulary (e.g. to a multiple of the TP degree)."},
          {LOOM_OPTION(S, n_layers),
           "Transformer layers, overriding the flavor's (e.g. a deeper debug model to split into more "
           "pipeline stages); `0` = the flavor's."},
          {LOOM_OPTION(S, attention_mask),
           "Which earlier tokens a token attends to. `causal`: every earlier token of its row. "
           "`block_causal`: only those of its own document (documents are packed into rows, each "
           "starting with BOS; the loader's own boundaries are used, so a BOS id inside a document's "
           "text does not cut it, and packed SFT examples never see each other), TorchTitan's default "
           "for pre-training."},
      },
      {},
      {},
      &options::validate_as<S, check>};
  return section;
}

}  // namespace loom::models
