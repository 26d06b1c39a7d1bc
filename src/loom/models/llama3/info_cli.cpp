// `loom info`: shape, parameter counts and training FLOPs per token of a Llama 3 flavor, from a
// model built on the meta device (no memory, instant even for 405B).
#include <cstdio>

#include "loom/models/llama3/cli.h"
#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/models/llama3/model.h"

namespace loom::llama3 {
namespace {
struct InfoOptions {
  std::string flavor = "debugmodel";
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
  llama3::ModelArgs args = llama3::flavor(
      o.flavor, o.vocab_size > 0 ? std::optional<int64_t>(o.vocab_size) : std::nullopt);
  LOOM_REQUIRE_USAGE(o.seq_len >= 0, "--seq-len must be positive, got ", o.seq_len);
  const int64_t seq_len = o.seq_len > 0 ? o.seq_len : args.max_seq_len;
  llama3::Transformer model(args, torch::TensorOptions().device(torch::kMeta));
  const llama3::ParameterCounts counts = llama3::count_parameters(model);
  const double flops = llama3::flops_per_token(args, counts.non_embedding, seq_len);
  const double seconds = timer.seconds();

  std::printf("flavor %s: %s\n", o.flavor.c_str(), args.summary().c_str());
  std::printf("parameters: total %s (%ld), embedding %s, non-embedding %s (%ld)\n",
              human(static_cast<double>(counts.total)).c_str(), static_cast<long>(counts.total),
              human(static_cast<double>(counts.embedding)).c_str(),
              human(static_cast<double>(counts.non_embedding)).c_str(),
              static_cast<long>(counts.non_embedding));
  std::printf("training FLOPs/token at seq_len %ld: %.4e (6N + 12 L H d_head T)\n",
              static_cast<long>(seq_len), flops);
  std::printf("fp32 weights: %.2f GiB; output head untied (Loom)\n",
              static_cast<double>(counts.total) * 4 / (1 << 30));
  if (o.modules) std::printf("%s", model.describe().c_str());
  std::printf("built on the meta device in %.3f s\n", seconds);
}
}  // namespace

void register_info_command(CLI::App& app) {
  auto options = std::make_shared<InfoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "info", "Parameter counts and FLOPs/token of a Llama 3 flavor (built on the meta device)");
  // Listed from the flavor table so the help cannot drift from it.
  std::string flavors;
  const std::vector<std::string> names = llama3::flavor_names();
  for (size_t i = 0; i < names.size(); ++i) {
    flavors += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  }
  cmd->add_option("--flavor", options->flavor, flavors)->capture_default_str();
  cmd->add_option("--seq-len", options->seq_len,
                  "Sequence length for the attention FLOPs (default: the flavor's max_seq_len)");
  cmd->add_option("--vocab-size", options->vocab_size, "Override the flavor's vocabulary size");
  cmd->add_flag("--modules", options->modules, "Also print the module tree with parameter shapes");
  cmd->callback([options] { run_info(*options); });
}

}  // namespace loom::llama3
