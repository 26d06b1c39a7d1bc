// `loom convert --input DIR --output DIR --to hf|loom|peft [--merge-adapter] [--base DIR]
// [--dtype float32|bfloat16|float16] [--device cpu|cuda|auto]`:
// converts a registered model's weights between a Hugging Face model directory and a Loom checkpoint (the input
// format is detected). `--to loom` writes a model-only checkpoint in the trainer's own format
// (rank-0.safetensors, metadata.json with CRC-32C per chunk and the model config, COMPLETE);
// `--input` may also be one of the trainer's checkpoints (step-N) or its checkpoint folder.
// `loom train` starts from either format through checkpoint.initial_load_path, and `loom score`
// reads both. An adapter input (a LoRA run's checkpoint, or a PEFT directory; on its recorded base
// or --base) converts to a PEFT directory (`--to peft`) or, merged, to a whole model
// (`--merge-adapter`).
#include <CLI/CLI.hpp>

#include "loom/core/dtype.h"
#include "loom/models/cli/cli.h"
#include "loom/core/device.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/timer.h"
#include "loom/lora/lora.h"
#include "loom/models/common/adapter_dir.h"
#include "loom/models/common/model_dir.h"

namespace loom::models {

void register_convert_command(CLI::App& app) {
  struct Args {
    std::string input, output, to, dtype;
    std::string device = "cpu";
    std::string base;
    bool merge_adapter = false;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("convert", "Convert model weights between a HF directory and a Loom checkpoint");
  cmd->add_option("--input", args->input, "HF model directory or Loom checkpoint (detected)")->required();
  cmd->add_option("--output", args->output, "Directory to write (must not exist)")->required();
  cmd->add_option("--to", args->to, "Output format: hf, loom, or peft (the adapters of a LoRA checkpoint or PEFT "
                  "directory)")
      ->required()
      ->check(CLI::IsMember({"hf", "loom", "peft"}));
  cmd->add_flag("--merge-adapter", args->merge_adapter,
                "Fold the input's LoRA adapters into the base weights (W + s B A) and write the merged model");
  cmd->add_option("--base", args->base,
                  "Base model directory of an adapter input (default: the base the adapter records)")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--dtype", args->dtype, "Stored dtype of the weights (default: float32)")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}));
  // The weights pass through this device (loaded there, written back from it): a checkpoint
  // trained on a GPU converts there, and the round trip through either device is exact.
  cmd->add_option("--device", args->device, "Device the weights are loaded on: cpu, cuda, or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->callback([args] {
    namespace fs = std::filesystem;
    LOOM_REQUIRE_USAGE(fs::weakly_canonical(args->input) != fs::weakly_canonical(args->output),
                       "convert: --output must differ from --input (", args->input, ")");
    LOOM_REQUIRE_USAGE(!fs::exists(args->output), "convert: --output '", args->output,
                       "' already exists; choose a new directory or remove it");
    LOOM_REQUIRE_USAGE(!(args->merge_adapter && args->to == "peft"), "convert: --merge-adapter writes a whole model; "
                       "use --to hf or --to loom with it (--to peft writes the adapters alone)");
    LoadOptions load;
    load.options = load.options.device(select_device(args->device, /*local_rank=*/0, "--device"));
    if (!args->base.empty()) load.base = args->base;
    auto loaded = load_model_dir(args->input, load);
    LOOM_REQUIRE_USAGE(args->base.empty() || loaded.adapter, "convert: --base is for an adapter input, and '",
                       args->input, "' is a whole model");
    std::optional<c10::ScalarType> dtype;
    if (!args->dtype.empty()) dtype = parse_dtype(args->dtype, "--dtype");
    // What is written (and merged) after the load: an adapter's hand-off cost against a merged
    // model's (bench/rl_policies.py).
    const Timer written;
    if (args->to == "peft") {
      LOOM_REQUIRE_USAGE(loaded.adapter.has_value(), "convert --to peft: '", args->input, "' holds no LoRA adapters "
                         "(a checkpoint of a run with lora.rank > 0, or a PEFT directory)");
      export_peft_dir(*loaded.spec, *loaded.model, loaded.adapter->options,
                      std::filesystem::absolute(loaded.source).lexically_normal().string(), args->output, dtype);
      log::info("converted ", args->input, " -> ", args->output, " (peft, base ", loaded.source.string(),
                "; written in ", written.seconds(), " s)");
      return;
    }
    if (loaded.adapter) {
      LOOM_REQUIRE_USAGE(args->merge_adapter, "convert: '", args->input, "' holds LoRA adapters: --to peft writes them, "
                         "--merge-adapter folds them into the base weights");
      lora::merge_lora(*loaded.model, loaded.adapter->options);
    } else {
      LOOM_REQUIRE_USAGE(!args->merge_adapter, "convert --merge-adapter: '", args->input, "' holds no LoRA adapters");
    }
    if (args->to == "hf") {
      export_hf_model_dir(*loaded.spec, *loaded.model, args->output, dtype);
    } else {
      save_loom_checkpoint(*loaded.spec, *loaded.model, args->output, dtype);
    }
    log::info("converted ", args->input, " -> ", args->output, " (", args->to,
              loaded.adapter ? "; merged and written in " : "; written in ", written.seconds(), " s)");
  });
}

}  // namespace loom::models
