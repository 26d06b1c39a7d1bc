#include "loom/train/training_data.h"

#include <ATen/Parallel.h>

#include "loom/core/logging.h"
#include "loom/core/strings.h"

namespace loom::train {
namespace {

std::string source_setting(size_t i) { return c10::str("training.datasets[", i, "]"); }

data::SourceOptions source_options(const TrainingSection& t, const data::SftConfig& sft) {
  data::SourceOptions source;
  source.format = data::source_format(t.dataset_format);
  source.jsonl_field = t.jsonl_field;
  source.text_column = t.text_column;
  if (t.token_cache) source.token_cache_dir = data::default_token_cache_dir();
  source.format_setting = "training.dataset_format";
  source.jsonl_field_setting = "training.jsonl_field";
  source.text_column_setting = "training.text_column";
  source.inputs_setting = "training.dataset_path";
  source.sft = sft;
  // Loading comes before the first step, on threads the step does not use yet.
  source.workers = t.data_workers > 0 ? t.data_workers : std::max(1, at::get_num_threads());
  return source;
}

}  // namespace

std::string training_data_name(const TrainingSection& t) {
  if (t.datasets.empty()) return t.dataset_path;
  return c10::str(t.datasets.size(), " sources mixed by weight ([[training.datasets]])");
}

void check_training_inputs(const TrainingSection& t) {
  if (t.datasets.empty()) {
    data::resolve_inputs({t.dataset_path}, "training.dataset_path");
    return;
  }
  for (size_t i = 0; i < t.datasets.size(); ++i) {
    data::resolve_inputs({t.datasets[i].path}, source_setting(i) + ".path",
                         data::directory_extension(data::source_format(t.datasets[i].format)));
  }
}

std::shared_ptr<const data::TokenCorpus> load_training_corpus(const TrainingSection& t, const data::SftConfig& sft,
                                                              const data::Tokenizer& tokenizer,
                                                              int64_t model_vocab_size) {
  const data::SourceOptions base = source_options(t, sft);
  if (t.datasets.empty()) return data::TokenCorpus::load({t.dataset_path}, &tokenizer, base, model_vocab_size);
  std::vector<data::MixtureSource> sources;
  for (size_t i = 0; i < t.datasets.size(); ++i) {
    const data::DatasetSource& d = t.datasets[i];
    data::SourceOptions source = base;
    source.format = data::source_format(d.format);
    if (!d.text_column.empty()) source.text_column = d.text_column;
    source.format_setting = source_setting(i) + ".format";
    source.text_column_setting = d.text_column.empty() ? "training.text_column" : source_setting(i) + ".text_column";
    source.inputs_setting = source_setting(i) + ".path";
    sources.push_back({data::TokenCorpus::load({d.path}, &tokenizer, source, model_vocab_size), d.weight,
                       c10::str(source_setting(i), " (", d.path, ")")});
  }
  auto corpus = data::TokenCorpus::mix(std::move(sources), static_cast<uint64_t>(t.seed));
  const std::vector<int64_t> counts = corpus->mixture_counts(corpus->num_documents());
  double total = 0.0;
  for (const auto& d : t.datasets) total += d.weight;
  for (size_t i = 0; i < counts.size(); ++i) {
    const auto& s = corpus->mixture()[i];
    log::info("data: ", s.name, ": ", s.corpus->num_documents(), " documents, weight ", s.weight, " (",
              100.0 * s.weight / total, " %): ", counts[i], " of the mixture's ", corpus->num_documents(),
              " documents per epoch");
  }
  return corpus;
}

}  // namespace loom::train
