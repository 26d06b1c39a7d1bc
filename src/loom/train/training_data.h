// The training data as the [training] section names it: one input (dataset_path, dataset_format)
// or a weighted mixture ([[training.datasets]]), loaded into one packed corpus (data/loader.h).
#pragma once
#include <cstdint>
#include <memory>

#include "loom/data/loader.h"
#include "loom/data/sft.h"
#include "loom/data/tokenizer.h"
#include "loom/train/sections.h"

namespace loom::train {

// Resolves every input the section names (stat only, nothing opened): a missing path, a glob that
// matches nothing or a FIFO is one line with exit 2, before any rendezvous.
void check_training_inputs(const TrainingSection& training);

// How the log names the training data: dataset_path, or "N sources mixed by weight".
std::string training_data_name(const TrainingSection& training);

// Loads the training corpus: dataset_path in dataset_format, or each [[training.datasets]] source in
// its own format mixed by weight (seeded by training.seed). Token ids are checked against the
// model's vocabulary; text is tokenized on training.data_workers threads.
std::shared_ptr<const data::TokenCorpus> load_training_corpus(const TrainingSection& training,
                                                              const data::SftConfig& sft,
                                                              const data::Tokenizer& tokenizer,
                                                              int64_t model_vocab_size);

}  // namespace loom::train
