// `loom info`: shape, parameter counts and training FLOPs per token of a registered model's
// flavor, from a model built on the meta device (no memory, instant even for 405B).
#include <cstdio>

#include "loom/models/cli/cli.h"
#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/model_dir.h"
#include "loom/models/spec.h"

namespace loom::models {
namespace {
struct InfoOptions {
  std::string model = "llama3";
  std::string flavor = "debugmodel";
  std::string checkpoint;  // a model directory: its recorded model instead of --model/--flavor
  int64_t seq_len = 0;
  int64_t vocab_size = 0;
  bool modules = false;
};

std::string human(double n) {
  const char* units[] = {"", "K", "M", "B", "T"};
  int u = 0;
  while (n >= 1000.0 && u < 4) {
    n /= 1000.0;
    ++u;
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f%s", n, units[u]);
  return text;
}

void run_info(const InfoOptions& o) {
  Timer timer;
  LOOM_REQUIRE_USAGE(o.seq_len >= 0, "--seq-len must be positive, got ", o.seq_len);
  LOOM_REQUIRE_USAGE(o.vocab_size >= 0, "--vocab-size must be positive, got ", o.vocab_size);
  const ModelSpec* spec_ptr = nullptr;
  std::unique_ptr<ModelArgs> args;
  std::string described = "flavor " + o.flavor;
  LOOM_REQUIRE_USAGE(o.flavor != kHfFlavor || !o.checkpoint.empty(), "--flavor ", kHfFlavor,
                     " is the shape of a Hugging Face config.json: pass the file or its model directory with "
                     "--checkpoint instead of --flavor");
  if (!o.checkpoint.empty()) {
    // The directory's own model (HF config.json or the Loom checkpoint's record), or a config.json
    // by itself (the shape model.flavor = "hf" trains); no weights read.
    ModelDirArgs recorded = std::filesystem::is_regular_file(o.checkpoint) ? read_hf_config(o.checkpoint)
                                                                           : read_model_dir_args(o.checkpoint);
    spec_ptr = recorded.spec;
    args = std::move(recorded.args);
    described = o.checkpoint;
  } else {
    spec_ptr = &get_spec(o.model);
    ModelRequest request;
    request.flavor = o.flavor;
    request.vocab_size = o.vocab_size;  // 0: the flavor's
    args = spec_ptr->build_args(request);
  }
  const ModelSpec& spec = *spec_ptr;
  const auto model = spec.build_model(*args, torch::TensorOptions().device(torch::kMeta));
  const auto* decoder = dynamic_cast<const DecoderArgs*>(args.get());
  const int64_t seq_len = o.seq_len > 0 ? o.seq_len : decoder != nullptr ? decoder->max_seq_len : 2048;
  ParameterCounts counts;
  for (const auto& p : model->named_parameters()) {
    counts.total += p.tensor().numel();
    if (p.name == "tok_embeddings.weight") counts.embedding += p.tensor().numel();
  }
  counts.non_embedding = counts.total - counts.embedding;
  // Active parameters from the spec's count by shapes (the built model does not say which a token
  // skips); the built and the counted totals must agree.
  const ParameterCounts counted = spec.count_parameters(*args);
  LOOM_REQUIRE(counted.total == counts.total, "model '", spec.name, "': its parameter count by shapes (", counted.total,
               ") differs from the built model's (", counts.total, ")");
  counts.active = counted.active;
  const double flops = spec.flops_per_token(*args, seq_len);
  const double seconds = timer.seconds();

  std::printf("%s %s: %s\n", spec.name.c_str(), described.c_str(), args->summary().c_str());
  std::printf("parameters: total %s (%ld), embedding %s, non-embedding %s (%ld)\n",
              human(static_cast<double>(counts.total)).c_str(), static_cast<long>(counts.total),
              human(static_cast<double>(counts.embedding)).c_str(),
              human(static_cast<double>(counts.non_embedding)).c_str(),
              static_cast<long>(counts.non_embedding));
  if (counts.active != counts.total) {
    // Model cards (gpt-oss's, Qwen3-MoE's) leave the token embedding, a lookup, out of "active".
    std::printf("active per token: %s (%ld) of %s (the experts a token is routed to); %s without the token "
                "embedding (the model cards' count)\n",
                human(static_cast<double>(counts.active)).c_str(), static_cast<long>(counts.active),
                human(static_cast<double>(counts.total)).c_str(),
                human(static_cast<double>(counts.active - counts.embedding)).c_str());
  }
  std::printf("training FLOPs/token at seq_len %ld: %.4e (6N + 6 L H (d_qk + d_v) T, N = active non-embedding)\n",
              static_cast<long>(seq_len), flops);
  std::printf("fp32 weights: %.2f GiB; output head %s\n", static_cast<double>(counts.total) * 4 / (1 << 30),
              decoder != nullptr && decoder->tie_embeddings ? "tied to the token embedding" : "untied");
  if (o.modules) std::printf("%s", model->describe().c_str());
  std::printf("built on the meta device in %.3f s\n", seconds);
}
}  // namespace

void register_info_command(CLI::App& app) {
  auto options = std::make_shared<InfoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "info", "Parameter counts and FLOPs/token of a model flavor (built on the meta device)");
  // Listed from the registry so the help cannot drift from it.
  std::string flavors;
  std::vector<std::string> models;
  for (const std::string_view name : spec_names()) {
    models.emplace_back(name);
    const ModelSpec& spec = get_spec(std::string(name));
    flavors += c10::str(flavors.empty() ? "" : "; ", name, ":");
    for (const std::string& f : spec.flavors) flavors += " " + f;
  }
  cmd->add_option("--model", options->model, "Registered model")->check(CLI::IsMember(models))->capture_default_str();
  cmd->add_option("--flavor", options->flavor, "Flavor of the model (" + flavors + ")")->capture_default_str();
  cmd->add_option("--checkpoint", options->checkpoint,
                  "Describe the model of this directory (Hugging Face or Loom format), or of a Hugging Face "
                  "config.json (what model.flavor = \"hf\" trains), instead of a flavor")
      ->check(CLI::ExistingPath)
      ->excludes(cmd->get_option("--flavor"))
      ->excludes(cmd->get_option("--model"));
  cmd->add_option("--seq-len", options->seq_len,
                  "Sequence length for the attention FLOPs (default: the flavor's max_seq_len)");
  cmd->add_option("--vocab-size", options->vocab_size, "Override the flavor's vocabulary size");
  cmd->add_flag("--modules", options->modules, "Also print the module tree with parameter shapes");
  cmd->callback([options] { run_info(*options); });
}

}  // namespace loom::models
