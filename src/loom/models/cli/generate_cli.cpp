// `loom generate`: sample a continuation of a prompt from a decoder model directory (Hugging Face
// or Loom format: `loom convert` output, or a training run's step-N), streaming tokens as they come.
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "loom/core/dtype.h"
#include "loom/core/device.h"
#include "loom/core/error.h"
#include "loom/core/error_report.h"
#include "loom/core/logging.h"
#include "loom/core/timer.h"
#include "loom/data/tokenizer.h"
#include "loom/models/cli/cli.h"
#include "loom/models/common/generate.h"
#include "loom/lora/lora.h"
#include "loom/models/common/adapter_dir.h"
#include "loom/models/common/model_dir.h"

namespace loom::models {
namespace {
namespace fs = std::filesystem;

struct GenerateOptions {
  std::string checkpoint;
  std::string prompt;
  std::string prompt_tokens;
  bool prompt_is_ids = false;  // --prompt-tokens was given (even empty): no tokenizer needed for it
  std::string tokenizer;
  std::string device = "cpu";
  std::string dtype = "float32";
  bool print_ids = false;
  bool no_bos = false;
  // Parsed signed so that a negative seed is refused instead of wrapping to a huge unsigned one.
  int64_t seed = 0;
  SamplingOptions sampling;
  std::vector<std::string> adapters;  // each generates in turn on the one loaded base
};

// The text of `ids`, leaving out ids the tokenizer has no token for. A model's vocabulary may be
// larger than its tokenizer's: checkpoints pad the embedding table (to a multiple of 64 or 128 for
// the GEMMs, or to fit a TP degree), and the padding rows can still be sampled. Hugging Face
// transformers accepts such a model and its `tokenizers` decode drops the ids it does not know, so
// a user of it expects generation to go on rather than be refused up front or stop mid-output;
// Loom does the same and says so once (--ids shows every sampled id).
std::string printable_text(const data::Tokenizer& tokenizer, const std::vector<int64_t>& ids) {
  std::vector<int64_t> known;
  known.reserve(ids.size());
  for (const int64_t id : ids) {
    if (id >= 0 && id < tokenizer.vocab_size()) known.push_back(id);
  }
  return tokenizer.decode(known, /*skip_special=*/true);
}

void run_generate(GenerateOptions o) {
  // Every option is checked before anything is read or allocated.
  o.sampling.validate();
  LOOM_REQUIRE_USAGE(o.seed >= 0, "--seed must be a non-negative integer, got ", o.seed,
                     "; the same seed gives the same tokens");
  o.sampling.seed = static_cast<uint64_t>(o.seed);
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::string tokenizer_path = o.tokenizer;
  if (tokenizer_path.empty() && fs::exists(fs::path(o.checkpoint) / "tokenizer.json")) {
    tokenizer_path = (fs::path(o.checkpoint) / "tokenizer.json").string();
  }
  if (!tokenizer_path.empty()) tokenizer = std::make_unique<data::Tokenizer>(data::Tokenizer::from_file(tokenizer_path));
  LOOM_REQUIRE_USAGE(tokenizer || o.prompt_is_ids,
                     "loom generate --prompt needs a tokenizer: pass --tokenizer tokenizer.json (none found in '",
                     o.checkpoint, "'), or give --prompt-tokens");
  std::vector<int64_t> prompt;
  if (o.prompt_is_ids) {
    prompt = data::parse_token_ids(o.prompt_tokens, "--prompt-tokens");
    LOOM_REQUIRE_USAGE(!prompt.empty(), "--prompt-tokens is empty: give at least one token id, e.g. --prompt-tokens 1");
  } else {
    prompt = tokenizer->encode(o.prompt, /*add_bos=*/!o.no_bos && tokenizer->bos_id() >= 0, /*add_eos=*/false);
  }
  LOOM_REQUIRE_USAGE(!prompt.empty(), "the prompt is empty");
  if (tokenizer && o.sampling.stop_id < 0) o.sampling.stop_id = tokenizer->eos_id();

  // The model's limits come from its config alone, before any weight is read: the prompt and the
  // new tokens must fit its maximum sequence length (a longer RoPE table would run the model past
  // what it was trained on), and this keeps a huge --max-new-tokens from allocating anything.
  const ModelDirArgs recorded = read_model_dir_args(o.checkpoint);
  const DecoderArgs& args = recorded.decoder();
  check_generation_fits(static_cast<int64_t>(prompt.size()), o.sampling.max_new_tokens, args.max_seq_len);
  for (const int64_t id : prompt) {
    LOOM_REQUIRE_USAGE(id < args.vocab_size, "prompt token id ", id, " is outside the model's vocabulary of ",
                       args.vocab_size, "; check the tokenizer matches the checkpoint");
  }
  if (tokenizer && tokenizer->vocab_size() < args.vocab_size && !o.print_ids) {
    log::warn("the tokenizer has ", tokenizer->vocab_size(), " ids but the model ", args.vocab_size,
              "; sampled ids without a token are left out of the text (as Hugging Face tokenizers do); "
              "--ids prints every id");
  }

  Timer load_timer;
  LoadOptions load;
  // Fits: checked against the model's own max_seq_len above.
  const int64_t capacity = static_cast<int64_t>(prompt.size()) + o.sampling.max_new_tokens;
  load.max_seq_len = capacity;
  const c10::ScalarType dtype = parse_dtype(o.dtype, "--dtype");
  load.memory_hint = dtype != torch::kFloat32 ? "use a machine with more memory or a smaller model"
                                              : "use --dtype bfloat16 (half the memory) or a machine with more memory";
  const c10::Device device = select_device(o.device, /*local_rank=*/0, "--device");
  load.options = torch::TensorOptions().dtype(dtype).device(device);
  const auto loaded = load_model_dir(o.checkpoint, load);
  Decoder& model = *loaded.model;
  model.eval();
  const double load_seconds = load_timer.seconds();

  // One generation with whatever adapters the model carries now.
  const auto generate_once = [&] {
    Generator generator(model, capacity,
                        c10::str("lower --max-new-tokens (the cache grows with prompt + new tokens)",
                                 dtype != torch::kFloat32 ? "" : " or use --dtype bfloat16"));
    std::vector<int64_t> produced;
    std::string shown;  // decoded text already printed: a token may end inside a UTF-8 character
    if (tokenizer && !o.print_ids) std::printf("%s", printable_text(*tokenizer, prompt).c_str());
    // From here stdout holds a line without its newline: an error must start a line of its own.
    set_stdout_line_open(true);
    std::fflush(stdout);
    Timer timer;
    generator.generate(prompt, o.sampling, [&](int64_t id) {
      produced.push_back(id);
      if (o.print_ids || !tokenizer) {
        std::printf("%s%lld", produced.size() == 1 ? "" : ",", static_cast<long long>(id));
      } else {
        const std::string text = printable_text(*tokenizer, produced);
        if (text.size() > shown.size() && text.compare(0, shown.size(), shown) == 0) {
          std::printf("%s", text.substr(shown.size()).c_str());
          shown = text;
        }
      }
      std::fflush(stdout);
    });
    const double seconds = timer.seconds();
    std::printf("\n");
    std::fflush(stdout);
    set_stdout_line_open(false);
    std::fprintf(stderr, "%zu prompt + %zu new tokens in %.2f s (%.1f tokens/s; load %.2f s) from %s\n", prompt.size(),
                 produced.size(), seconds, static_cast<double>(produced.size()) / std::max(seconds, 1e-9), load_seconds,
                 loaded.source.string().c_str());
  };
  if (o.adapters.empty()) {
    generate_once();
    return;
  }
  // Many adapters over one resident base: each is attached (only its bytes are read), generates
  // and is taken off again; the base is never reloaded. Sampling restarts from --seed for each.
  LOOM_REQUIRE_USAGE(!loaded.adapter, "--checkpoint '", o.checkpoint, "' is itself an adapter; with --adapter, "
                     "--checkpoint is the base model they share");
  with_each_adapter(*loaded.spec, model, loaded.source, o.adapters,
                    [&](size_t i, const AdapterDir& adapter, double attach_seconds, int64_t bytes) {
                      std::fprintf(stderr, "adapter %zu/%zu: %s: attached in %.3f s, %ld bytes read\n", i + 1,
                                   o.adapters.size(), adapter.describe().c_str(), attach_seconds,
                                   static_cast<long>(bytes));
                      generate_once();
                    });
}

}  // namespace

void register_generate_command(CLI::App& app) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Sample a continuation of a prompt (key/value cache, streamed)");
  cmd->add_option("--checkpoint", options->checkpoint, "Model directory (Hugging Face or Loom format)")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* text = cmd->add_option("--prompt", options->prompt, "Prompt text (tokenized with --tokenizer)");
  auto* ids = cmd->add_option("--prompt-tokens", options->prompt_tokens, "Prompt as comma-separated token ids");
  text->excludes(ids);
  cmd->add_option("--tokenizer", options->tokenizer, "tokenizer.json (default: the checkpoint's)")
      ->check(CLI::ExistingFile);
  // Numeric ranges are checked by SamplingOptions::validate, not CLI11's Range validators: those
  // print their bounds with %f (DBL_MAX in 309 digits, "Value 0 not in range 0.000000 to ...")
  // and let NaN through to the sampler.
  cmd->add_option("--max-new-tokens", options->sampling.max_new_tokens,
                  "Tokens to generate, >= 1 (default 64; prompt + new tokens must fit the model's max_seq_len)");
  cmd->add_option("--temperature", options->sampling.temperature, "0 = greedy; else logits / T (default 0.8)");
  cmd->add_option("--top-k", options->sampling.top_k, "Sample among the k most likely tokens; 0 = all");
  cmd->add_option("--top-p", options->sampling.top_p, "Nucleus sampling, in (0, 1]: smallest set with probability >= p");
  cmd->add_option("--seed", options->seed, "Sampling seed, >= 0: the same seed gives the same tokens (default 0)");
  cmd->add_flag("--no-bos", options->no_bos, "Do not prepend the tokenizer's BOS to --prompt");
  cmd->add_flag("--ids", options->print_ids, "Print the new token ids (comma-separated) instead of text");
  cmd->add_option("--adapter", options->adapters,
                  "LoRA adapter directory (PEFT, or a LoRA run's checkpoint) to generate with on the --checkpoint "
                  "base; repeatable: the base is loaded once and each adapter in turn attached, run and removed")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--device", options->device, "cpu, cuda, or auto (the GPU when there is one)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--dtype", options->dtype, "Dtype the model computes in (default: float32)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  cmd->callback([options, text, ids] {
    LOOM_REQUIRE_USAGE(text->count() + ids->count() == 1, "loom generate needs exactly one of --prompt or --prompt-tokens");
    options->prompt_is_ids = ids->count() > 0;
    run_generate(*options);
  });
}

}  // namespace loom::models
