// `loom tokenizer {train,encode,decode,pretokenize}`.
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/data/tokenizer_cli.h"
#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/data/bpe_trainer.h"
#include "loom/data/parallel_encoder.h"
#include "loom/data/sources.h"
#include "loom/data/tokenizer.h"

namespace loom::data {

namespace {

using data::Tokenizer;

void write_stdout(const std::string& s) {
  if (std::fwrite(s.data(), 1, s.size(), stdout) != s.size()) fail("cannot write to standard output");
}

void append_ids(const std::vector<int64_t>& ids, std::string& out) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ' ';
    out += std::to_string(ids[i]);
  }
  out += '\n';
}


struct SourceArgs {
  std::string text_separator;
  std::string jsonl_field = "text";
  std::string text_column = "text";
  std::string format = "auto";
  int64_t workers = 1;
  // Unless --format names one, the format is guessed per file (these commands take mixed inputs);
  // errors name the flags.
  data::SourceOptions options() const {
    data::SourceOptions o;
    o.text_separator = text_separator;
    o.jsonl_field = jsonl_field;
    o.jsonl_field_setting = "--jsonl-field";
    o.text_column = text_column;
    o.text_column_setting = "--text-column";
    o.format_setting = "--format";
    if (format != "auto") o.format = data::parse_source_format(format);
    o.workers = workers;
    return o;
  }
};

// An --output that is a directory would fail only after all the work (and, before the writers
// cleaned up, left "<output>.tmp" in the directory): refuse it before reading any input.
void check_output_file(const std::string& output, const char* example) {
  std::error_code ec;
  LOOM_REQUIRE_USAGE(!std::filesystem::is_directory(output, ec), "--output '", output,
                     "' is a directory; pass a file path such as ",
                     (std::filesystem::path(output) / example).string());
}

void add_source_options(CLI::App* cmd, SourceArgs& args) {
  cmd->add_option("--text-separator", args.text_separator,
                  "Split text files into documents at this string (e.g. $'\\n\\n'); default: one file, one document");
  cmd->add_option("--jsonl-field", args.jsonl_field, "JSONL field holding the document text")
      ->capture_default_str();
  cmd->add_option("--text-column", args.text_column, "Parquet/Arrow column holding the document text")
      ->capture_default_str();
  cmd->add_option("--format", args.format, "Format of every input: auto (guess each file's), jsonl, text, parquet, arrow")
      ->check(CLI::IsMember({"auto", "jsonl", "text", "parquet", "arrow"}))
      ->capture_default_str();
}

void register_train(CLI::App* parent) {
  struct Args {
    std::vector<std::string> inputs;
    int64_t vocab_size = 2048;
    int64_t min_frequency = 2;
    std::string output;
    SourceArgs source;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = parent->add_subcommand(
      "train", "Train a byte-level BPE tokenizer (GPT-2 pre-tokenizer) and write a Hugging Face tokenizer.json");
  cmd->add_option("--input", args->inputs, "Text or JSONL files, directories or globs")->required();
  cmd->add_option("--vocab-size", args->vocab_size, "Vocabulary size including 256 byte tokens and 3 special tokens")
      ->capture_default_str();
  cmd->add_option("--min-frequency", args->min_frequency, "Stop merging when the best pair is rarer than this")
      ->capture_default_str();
  cmd->add_option("--output", args->output, "Where to write tokenizer.json")->required();
  add_source_options(cmd, args->source);
  cmd->callback([args] {
    check_output_file(args->output, "tokenizer.json");
    Timer timer;
    data::BpeTrainerOptions options;
    options.vocab_size = args->vocab_size;
    options.min_frequency = args->min_frequency;
    data::BpeTrainer trainer(options);
    int64_t documents = 0, bytes = 0;
    for (const std::string& path : data::resolve_inputs(args->inputs)) {
      data::for_each_text_document(path, args->source.options(), [&](std::string_view doc) {
        trainer.add_text(doc);
        ++documents;
        bytes += static_cast<int64_t>(doc.size());
      });
    }
    std::string inputs;
    for (const std::string& i : args->inputs) inputs += (inputs.empty() ? "'" : ", '") + i + "'";
    // A tokenizer of byte tokens only is never what was meant: the inputs were empty, or the
    // JSONL/text split found nothing in them.
    LOOM_REQUIRE(documents > 0, "--input ", inputs, " holds no documents (every file is empty or has only ",
                 "empty documents); give files with text to train the tokenizer on");
    const data::BpeTrainingResult r = trainer.train();
    trainer.save(args->output);
    std::printf("trained tokenizer: vocab %lld (%lld merges) from %lld documents, %lld bytes, %lld distinct words "
                "in %.2f s (merging %.2f s) -> %s\n",
                static_cast<long long>(r.vocab_size), static_cast<long long>(r.num_merges),
                static_cast<long long>(documents), static_cast<long long>(bytes),
                static_cast<long long>(r.num_words), timer.seconds(), r.seconds, args->output.c_str());
    if (r.vocab_size < args->vocab_size) {
      std::printf("note: the text ran out of pairs occurring %lld+ times before vocab %lld\n",
                  static_cast<long long>(args->min_frequency), static_cast<long long>(args->vocab_size));
    }
  });
}

void register_encode(CLI::App* parent) {
  struct Args {
    std::string tokenizer, text, text_file, jsonl, field = "text";
    bool bos = false, eos = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = parent->add_subcommand(
      "encode", "Print token ids, space-separated: one line for --text/--text-file, one line per document for --jsonl");
  cmd->add_option("--tokenizer", args->tokenizer, "tokenizer.json")->required();
  auto* text = cmd->add_option("--text", args->text, "Text to encode");
  auto* text_file = cmd->add_option("--text-file", args->text_file, "File whose whole contents are encoded");
  auto* jsonl = cmd->add_option("--jsonl", args->jsonl, "JSONL file: encode each line's --field");
  text->excludes(text_file)->excludes(jsonl);
  text_file->excludes(jsonl);
  cmd->add_option("--field", args->field, "JSONL field to encode")->capture_default_str();
  cmd->add_flag("--bos", args->bos, "Prepend the BOS token");
  cmd->add_flag("--eos", args->eos, "Append the EOS token");
  cmd->callback([args, text, text_file, jsonl] {
    LOOM_REQUIRE_USAGE(text->count() + text_file->count() + jsonl->count() == 1,
                       "tokenizer encode needs one of --text, --text-file or --jsonl");
    const Tokenizer tok = Tokenizer::from_file(args->tokenizer);
    std::string out;
    if (jsonl->count()) {
      data::SourceOptions options;
      options.jsonl_field = args->field;
      options.jsonl_field_setting = "--field";
      options.skip_empty = false;  // one output line per input line
      LOOM_REQUIRE_USAGE(data::detect_format(args->jsonl) == data::SourceFormat::kJsonl, "--jsonl '",
                         args->jsonl, "' must be a .jsonl file");
      data::for_each_text_document(args->jsonl, options, [&](std::string_view doc) {
        append_ids(tok.encode(doc, args->bos, args->eos), out);
      });
    } else {
      const std::string input = text->count() ? args->text : data::read_file(args->text_file, "text file");
      append_ids(tok.encode(input, args->bos, args->eos), out);
    }
    write_stdout(out);
  });
}

void register_decode(CLI::App* parent) {
  struct Args {
    std::string tokenizer, ids, ids_file;
    bool skip_special = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = parent->add_subcommand(
      "decode", "Print the text of token ids (--ids), or one JSON line {\"text\": ...} per line of --ids-file");
  cmd->add_option("--tokenizer", args->tokenizer, "tokenizer.json")->required();
  auto* ids = cmd->add_option("--ids", args->ids, "Token ids separated by commas or spaces, e.g. 1,2,3");
  auto* ids_file = cmd->add_option("--ids-file", args->ids_file, "File with one sequence of ids per line");
  ids->excludes(ids_file);
  cmd->add_flag("--skip-special", args->skip_special, "Leave special tokens out of the text");
  cmd->callback([args, ids, ids_file] {
    LOOM_REQUIRE_USAGE(ids->count() + ids_file->count() == 1, "tokenizer decode needs --ids or --ids-file");
    const Tokenizer tok = Tokenizer::from_file(args->tokenizer);
    if (ids->count()) {
      write_stdout(tok.decode(parse_token_ids(args->ids, "--ids"), args->skip_special) + "\n");
      return;
    }
    const std::string content = data::read_file(args->ids_file, "ids file");
    std::string out;
    size_t line_no = 0, begin = 0;
    while (begin < content.size()) {
      size_t end = content.find('\n', begin);
      if (end == std::string::npos) end = content.size();
      ++line_no;
      const std::string line = content.substr(begin, end - begin);
      const std::string text = tok.decode(parse_token_ids(line, c10::str(args->ids_file, ":", line_no)), args->skip_special);
      out += nlohmann::json{{"text", text}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      out += '\n';
      begin = end + 1;
    }
    write_stdout(out);
  });
}

void register_pretokenize(CLI::App* parent) {
  struct Args {
    std::string tokenizer, output;
    std::vector<std::string> inputs;
    SourceArgs source;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = parent->add_subcommand(
      "pretokenize", "Tokenize text/JSONL documents into a memory-mappable loom token file (see data/sources.h)");
  cmd->add_option("--tokenizer", args->tokenizer, "tokenizer.json")->required();
  cmd->add_option("--input", args->inputs, "Text or JSONL files, directories or globs")->required();
  cmd->add_option("--output", args->output, "Token file to write, e.g. corpus.bin")->required();
  add_source_options(cmd, args->source);
  cmd->add_option("--workers", args->source.workers, "Threads that tokenize while the input is read")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->callback([args] {
    check_output_file(args->output, "corpus.bin");
    Timer timer;
    const Tokenizer tok = Tokenizer::from_file(args->tokenizer);
    data::TokenFileWriter writer(args->output, tok.vocab_size(), tok.bos_id(), tok.eos_id());
    int64_t bytes = 0;
    const data::SourceOptions options = args->source.options();
    data::ParallelEncoder encoder(tok, args->source.workers,
                                  [&](const std::vector<int64_t>& tokens) { writer.add_document(tokens); });
    for (const std::string& path :
         data::resolve_inputs(args->inputs, "--input", data::directory_extension(options.format))) {
      data::for_each_text_document(path, options, [&](std::string_view doc) {
        encoder.add(doc);
        bytes += static_cast<int64_t>(doc.size());
      });
    }
    encoder.finish();
    writer.close();
    const data::TokenFileHeader& h = writer.header();
    std::printf("pretokenized %lld documents, %lld bytes -> %lld tokens (uint%d, EOS %lld after each) in %.2f s -> %s\n",
                static_cast<long long>(h.num_documents), static_cast<long long>(bytes),
                static_cast<long long>(h.num_tokens), static_cast<int>(h.bytes_per_token * 8),
                static_cast<long long>(h.eos_id), timer.seconds(), args->output.c_str());
  });
}

}  // namespace

void register_tokenizer_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("tokenizer", "Train, apply and inspect byte-level BPE tokenizers (tokenizer.json)");
  cmd->require_subcommand(1);
  register_train(cmd);
  register_encode(cmd);
  register_decode(cmd);
  register_pretokenize(cmd);
}

}  // namespace loom::data
