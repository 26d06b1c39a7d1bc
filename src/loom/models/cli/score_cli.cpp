// `loom score`: per-token negative log-likelihood and perplexity of a token sequence under a
// model directory (Hugging Face or Loom format), optionally saving the logits.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "loom/core/dtype.h"
#include "loom/models/cli/cli.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/device.h"
#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/data/sources.h"
#include "loom/data/tokenizer.h"
#include "loom/lora/lora.h"
#include "loom/models/common/adapter_dir.h"
#include "loom/models/common/model_dir.h"

namespace loom::models {
namespace {
namespace fs = std::filesystem;

struct ScoreOptions {
  std::string checkpoint;
  std::string tokens;
  std::string text_file;
  std::string tokenizer;
  std::string logits_out;
  std::string device = "cpu";
  std::string dtype = "float32";
  bool no_bos = false;
  std::vector<std::string> adapters;  // each scored in turn on the one loaded base
};

std::vector<int64_t> tokens_from_text(const ScoreOptions& o) {
  std::string tokenizer_path = o.tokenizer;
  if (tokenizer_path.empty()) {
    tokenizer_path = (fs::path(o.checkpoint) / "tokenizer.json").string();
    LOOM_REQUIRE_USAGE(fs::exists(tokenizer_path), "--text-file needs a tokenizer: pass "
                       "--tokenizer tokenizer.json (none found in '", o.checkpoint, "')");
  }
  // Read without blocking and only if it is a regular file: a FIFO with no writer would make a
  // plain open wait forever.
  const std::string text = data::read_file(o.text_file, "--text-file");
  const data::Tokenizer tokenizer = data::Tokenizer::from_file(tokenizer_path);
  const bool add_bos = !o.no_bos && tokenizer.bos_id() >= 0;
  return tokenizer.encode(text, add_bos, /*add_eos=*/false);
}

// One forward over `tokens` and its per-token NLL table; the logits are added to `logits_out`
// (safetensors) under `logits_name` when a path is given.
void score_once(Decoder& model, const torch::Tensor& tokens, const std::vector<int64_t>& ids,
                const c10::Device& device, const std::string& logits_out, const std::string& logits_name) {
  torch::InferenceMode inference;
  const auto seq_len = static_cast<int64_t>(ids.size());
  Timer forward_timer;
  // Computed on the device in the model's dtype; scored in fp32 on the host.
  const torch::Tensor logits =
      model.forward(tokens.to(device)).squeeze(0).to(torch::kCPU, torch::kFloat32);  // [T, V]
  const double forward_seconds = forward_timer.seconds();

  // NLL of token t+1 given tokens 0..t.
  const torch::Tensor log_probs = torch::log_softmax(logits.narrow(0, 0, seq_len - 1), -1);
  const torch::Tensor targets = tokens.squeeze(0).narrow(0, 1, seq_len - 1).unsqueeze(1);
  const torch::Tensor nll = -log_probs.gather(1, targets).squeeze(1).to(torch::kFloat64);
  const auto nll_values = nll.accessor<double, 1>();
  std::printf("%8s %10s %12s\n", "position", "token", "nll");
  for (int64_t t = 1; t < seq_len; ++t) {
    std::printf("%8ld %10ld %12.6f\n", static_cast<long>(t), static_cast<long>(ids[t]), nll_values[t - 1]);
  }
  const double mean_nll = nll.mean().item<double>();
  std::printf("tokens scored: %ld  mean NLL: %.8f  perplexity: %.6f\n", static_cast<long>(seq_len - 1), mean_nll,
              std::exp(mean_nll));
  std::printf("forward: %.3f s\n", forward_seconds);
  if (!logits_out.empty()) {
    // Several adapters write one file: the tensors of those before are kept.
    checkpoint::NamedTensors tensors;
    if (logits_name != "logits" && fs::exists(logits_out)) {
      const auto previous = checkpoint::SafetensorsCheckpoint::open(logits_out);
      for (const std::string& name : previous.names()) tensors.emplace_back(name, previous.tensor(name).clone());
    }
    tensors.emplace_back(logits_name, logits.contiguous());
    checkpoint::save_safetensors(logits_out, tensors);
    std::printf("logits [%ld, %ld] fp32 written to %s as '%s'\n", static_cast<long>(seq_len),
                static_cast<long>(logits.size(1)), logits_out.c_str(), logits_name.c_str());
  }
}

void run_score(const ScoreOptions& o) {
  const std::vector<int64_t> ids =
      o.text_file.empty() ? data::parse_token_ids(o.tokens, "--tokens") : tokens_from_text(o);
  LOOM_REQUIRE_USAGE(ids.size() >= 2, "need at least 2 tokens to score, got ", ids.size());
  const auto seq_len = static_cast<int64_t>(ids.size());

  Timer load_timer;
  LoadOptions load;
  load.max_seq_len = seq_len;  // the RoPE cache only needs this sequence
  const c10::Device device = select_device(o.device, /*local_rank=*/0, "--device");
  // Past the positions the model was made for, RoPE extrapolates and the scores mean nothing.
  const int64_t trained_len = read_model_dir_args(o.checkpoint).decoder().max_seq_len;
  LOOM_REQUIRE_USAGE(seq_len <= trained_len, "the ", seq_len, " tokens to score are more than the model's max_seq_len of ",
                     trained_len, " (", o.checkpoint, "); score at most ", trained_len,
                     " tokens at a time, e.g. in windows");
  load.options = torch::TensorOptions()
                     .dtype(parse_dtype(o.dtype, "--dtype"))
                     .device(device);
  const auto loaded = load_model_dir(o.checkpoint, load);
  Decoder& model = *loaded.model;
  model.eval();
  const int64_t vocab = model.decoder_args().vocab_size;
  for (const int64_t id : ids) {
    LOOM_REQUIRE_USAGE(id < vocab, "token id ", id, " is outside the model's vocabulary of ",
                       vocab, "; check the tokenizer matches the checkpoint");
  }
  const double load_seconds = load_timer.seconds();

  const torch::Tensor tokens = torch::tensor(ids, torch::kInt64).unsqueeze(0);
  std::printf("checkpoint: %s (%s), %s; %s on %s\n", o.checkpoint.c_str(),
              loaded.format == ModelDirFormat::kLoom ? "loom" : "huggingface",
              model.decoder_args().summary().c_str(), o.dtype.c_str(), device.str().c_str());
  if (loaded.adapter) std::printf("with %s\n", loaded.adapter->describe().c_str());
  std::printf("base load: %.3f s\n", load_seconds);
  if (o.adapters.empty()) {
    score_once(model, tokens, ids, device, o.logits_out, "logits");
    return;
  }
  // Many adapters over one resident base: each is attached (only its bytes are read), scored and
  // taken off again; the base is never reloaded.
  LOOM_REQUIRE_USAGE(!loaded.adapter, "--checkpoint '", o.checkpoint, "' is itself an adapter; with --adapter, "
                     "--checkpoint is the base model they share");
  with_each_adapter(*loaded.spec, model, loaded.source, o.adapters,
                    [&](size_t i, const AdapterDir& adapter, double attach_seconds, int64_t bytes) {
                      std::printf("\nadapter %zu/%zu: %s: attached in %.3f s, %ld bytes read\n", i + 1,
                                  o.adapters.size(), adapter.describe().c_str(), attach_seconds,
                                  static_cast<long>(bytes));
                      score_once(model, tokens, ids, device, o.logits_out,
                                 o.adapters.size() == 1 ? std::string("logits") : c10::str("logits.", i));
                    });
  std::printf("\n%zu adapters scored over 1 base load\n", o.adapters.size());
}
}  // namespace

void register_score_command(CLI::App& app) {
  auto options = std::make_shared<ScoreOptions>();
  CLI::App* cmd = app.add_subcommand(
      "score", "Per-token NLL and perplexity of a sequence under a model directory");
  cmd->add_option("--checkpoint", options->checkpoint,
                  "Model directory (Hugging Face or Loom format)")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* tokens = cmd->add_option("--tokens", options->tokens, "Comma-separated token ids, e.g. 1,2,3");
  auto* text = cmd->add_option("--text-file", options->text_file, "Text to tokenize and score")
                   ->check(CLI::ExistingFile);
  tokens->excludes(text);
  cmd->add_option("--tokenizer", options->tokenizer,
                  "tokenizer.json for --text-file (default: the checkpoint's)")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--no-bos", options->no_bos, "Do not prepend the tokenizer's BOS to --text-file");
  cmd->add_option("--device", options->device,
                  "Device to run the model on: cpu, cuda, or auto (the GPU when there is one)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--dtype", options->dtype, "Dtype the model computes in (default: float32)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  cmd->add_option("--logits-out", options->logits_out,
                  "Write the logits [T, V] fp32 as safetensors tensor 'logits' ('logits.<i>' for the i-th of several "
                  "--adapter)");
  cmd->add_option("--adapter", options->adapters,
                  "LoRA adapter directory (PEFT, or a LoRA run's checkpoint) to score on the --checkpoint base; "
                  "repeatable: the base is loaded once and each adapter in turn attached, scored and removed")
      ->check(CLI::ExistingDirectory);
  cmd->callback([options, tokens, text] {
    LOOM_REQUIRE_USAGE(tokens->count() + text->count() == 1,
                       "loom score needs exactly one of --tokens or --text-file");
    run_score(*options);
  });
}

}  // namespace loom::models
