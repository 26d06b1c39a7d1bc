// `loom convert --input DIR --output DIR --to hf|loom [--dtype float32|bfloat16|float16]`:
// converts a Llama model directory between the Hugging Face layout and Loom's (the input format is
// detected from its config.json). `loom train` starts from either through
// checkpoint.initial_load_path.
#include <CLI/CLI.hpp>

#include "loom/apps/commands.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/models/llama3/model_dir.h"

namespace loom::apps {

void register_convert_command(CLI::App& app) {
  struct Args {
    std::string input, output, to, dtype;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("convert", "Convert a Llama model directory between HF and Loom layouts");
  cmd->add_option("--input", args->input, "Model directory (HF or Loom; detected)")->required();
  cmd->add_option("--output", args->output, "Directory to write (created)")->required();
  cmd->add_option("--to", args->to, "Output layout")->required()->check(CLI::IsMember({"hf", "loom"}));
  cmd->add_option("--dtype", args->dtype, "HF export dtype (default: as loaded, float32)")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}));
  cmd->callback([args] {
    namespace fs = std::filesystem;
    LOOM_REQUIRE_USAGE(fs::weakly_canonical(args->input) != fs::weakly_canonical(args->output),
                       "convert: --output must differ from --input (", args->input, ")");
    auto loaded = llama3::load_model_dir(args->input);
    if (args->to == "hf") {
      std::optional<c10::ScalarType> dtype;
      if (args->dtype == "bfloat16") dtype = torch::kBFloat16;
      if (args->dtype == "float16") dtype = torch::kFloat16;
      if (args->dtype == "float32") dtype = torch::kFloat32;
      llama3::export_hf_model_dir(*loaded.model, args->output, dtype);
    } else {
      LOOM_REQUIRE_USAGE(args->dtype.empty() || args->dtype == "float32",
                         "convert --to loom keeps float32 weights; drop --dtype ", args->dtype);
      llama3::save_model_dir(*loaded.model, args->output);
    }
    log::info("converted ", args->input, " -> ", args->output, " (", args->to, ")");
  });
}

}  // namespace loom::apps
