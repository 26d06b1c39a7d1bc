#include "loom/models/config.h"

#include "loom/models/common/model_dir.h"
#include "loom/models/spec.h"

namespace loom::models {

namespace {
void check(const ModelConfig& m) {
  const options::Section& s = model_section();
  options::require(m.vocab_size >= 0, s, "vocab_size", ">= 0", &m);
  options::require(m.n_layers >= 0, s, "n_layers", ">= 0 (0 = the flavor's)", &m);
  options::require(m.hf_config.empty() || m.flavor == kHfFlavor, s, "hf_config",
                   "empty unless model.flavor = \"hf\" (it is the config.json that flavor reads)", &m);
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
           "flavors decides what is valid), or `hf`: the shape a Hugging Face `config.json` gives "
           "(`model.hf_config`, else that of `checkpoint.initial_load_path` when it is a Hugging Face "
           "model directory), read by the family's Hugging Face reader, so a fine-tuned or pruned model "
           "with its own widths, layers, heads, vocabulary or experts trains at its own shape. Its "
           "`model_type` must be `model.name`'s family, the vocabulary and layers are the file's "
           "(`model.vocab_size` and `model.n_layers` must be `0` or equal them), and a field Loom "
           "cannot express is refused in one line naming it."},
          {LOOM_OPTION(S, tokenizer_path),
           "Hugging Face `tokenizer.json` (byte-level BPE). `make train` creates the default one from"
           " the bundled corpus."},
          {LOOM_OPTION(S, vocab_size),
           "Rows of the token embedding and output projection; `0` = the tokenizer's vocabulary size."
           " A larger value pads the vocabulary (e.g. to a multiple of the TP degree)."},
          {LOOM_OPTION(S, n_layers),
           "Transformer layers, overriding the flavor's (e.g. a deeper debug model to split into more "
           "pipeline stages); `0` = the flavor's."},
          {LOOM_OPTION(S, hf_config),
           "With `model.flavor = \"hf\"`: the Hugging Face `config.json` (or the directory holding it) "
           "whose shape to train; empty = that of `checkpoint.initial_load_path`, which must then be a "
           "Hugging Face model directory. Only the shape is read: the weights come from "
           "`checkpoint.initial_load_path`, or are initialized from `training.seed`."},
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

ModelRequest model_request(const ModelConfig& model, const std::string& initial_load_path, int64_t vocab_size,
                           int64_t seq_len) {
  ModelRequest request{model.flavor, vocab_size, seq_len, model.n_layers};
  if (model.flavor == kHfFlavor) {
    request.hf_config = resolve_hf_config(model.hf_config, initial_load_path);
    request.vocab_size = model.vocab_size;  // the file's when 0
    request.min_vocab_size = vocab_size;
  }
  return request;
}

}  // namespace loom::models
