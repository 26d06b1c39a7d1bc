// SFT data (sft.h): rendering with the Llama 3 and ChatML templates, the masks, packing masked
// examples into rows, and the one-line errors. The loss against a Python reference on a chat file
// is tests/parity/test_sft_masking.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/data/byte_level.h"
#include "loom/data/loader.h"
#include "loom/data/sft.h"
#include "loom/data/sources.h"
#include "loom/data/tokenizer.h"
#include "loom/testing/errors.h"
#include "loom/testing/files.h"

// Everything in a named namespace: the tests' helpers and usings stay out of the unity batch's
// other files.
namespace sft_test {

namespace fs = std::filesystem;
using loom::data::ChatTemplate;
using loom::data::SftConfig;
using loom::data::SftExample;
using loom::data::SftRenderer;
using loom::data::Tokenizer;
using nlohmann::json;

// A byte-level tokenizer without merges: every byte is its own token (id = byte value), so the ids
// of any text are its bytes, plus the added special tokens from id 256 on, and `vocab_extra`
// spellings in the BPE vocabulary (reachable by token_to_id only).
Tokenizer byte_tokenizer(const std::vector<std::string>& specials, const std::vector<std::string>& vocab_extra = {}) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[loom::data::byte_level::to_alphabet(std::string(1, static_cast<char>(b)))] = b;
  int id = 256;
  json added = json::array();
  for (const std::string& s : specials) {
    added.push_back({{"id", id++}, {"content", s}, {"special", true}, {"normalized", false}});
  }
  for (const std::string& s : vocab_extra) vocab[loom::data::byte_level::to_alphabet(s)] = id++;
  const json j = {{"version", "1.0"},
                  {"added_tokens", added},
                  {"normalizer", nullptr},
                  {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                  {"decoder", {{"type", "ByteLevel"}}},
                  {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
  return Tokenizer::from_json_string(j.dump(), "tiny.json");
}

// Llama 3's: <|begin_of_text|> 256, <|end_of_text|> 257, <|start_header_id|> 258,
// <|end_header_id|> 259, <|eot_id|> 260.
Tokenizer llama3_tokenizer() {
  return byte_tokenizer({"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"});
}
constexpr int64_t kL3Bos = 256, kL3Eos = 257, kHeader = 258, kEndHeader = 259, kEot = 260;

// Qwen's: <|endoftext|> 256 (BOS and EOS), <|im_start|> 257, <|im_end|> 258.
Tokenizer chatml_tokenizer() { return byte_tokenizer({"<|endoftext|>", "<|im_start|>", "<|im_end|>"}); }
constexpr int64_t kImStart = 257, kImEnd = 258;

// Appends the byte ids of `text` with flag `trained`.
void add_text(SftExample& e, const std::string& text, bool trained) {
  for (unsigned char c : text) {
    e.tokens.push_back(c);
    e.trained.push_back(trained ? 1 : 0);
  }
}
void add_token(SftExample& e, int64_t id, bool trained) {
  e.tokens.push_back(id);
  e.trained.push_back(trained ? 1 : 0);
}

std::string joined(const std::vector<loom::data::SftSegment>& segments) {
  std::string out;
  for (const auto& s : segments) out += s.text;
  return out;
}

// A conversation with a system prompt, two user turns and two answers; contents carry the
// whitespace the Llama 3 template strips (Jinja's trim, Python's str.strip: U+001F and U+3000
// included) and ChatML keeps.
const json kChat = json::parse(R"({"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi?\n"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "\u001f2+2\u3000"},
    {"role": "assistant", "content": " 4 \n"}]})");

loom::data::SourceOptions sft_options() {
  loom::data::SourceOptions o;
  o.format = loom::data::SourceFormat::kSft;
  o.format_setting = "training.dataset_format";
  return o;
}

// Every example of an sft file, as the loader renders them.
std::vector<SftExample> examples_of(const fs::path& path, const Tokenizer& tokenizer, const SftConfig& config = {}) {
  const SftRenderer renderer(tokenizer, config);
  std::vector<SftExample> out;
  loom::data::for_each_sft_example(path.string(), sft_options(), renderer,
                                   [&](const SftExample& e) { out.push_back(e); });
  return out;
}

TEST(Sft, Llama3RendersLikeTheHfTemplateAndTrainsAnswersOnly) {
  const Tokenizer tok = llama3_tokenizer();
  const SftRenderer renderer(tok, {});
  ASSERT_EQ(renderer.chat_template(), ChatTemplate::kLlama3);  // auto, from the tokenizer's tokens
  // Meta-Llama-3-Instruct's template after its bos_token: each message's content stripped.
  EXPECT_EQ(joined(renderer.render(kChat, "chat.jsonl:1")),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\n2+2<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>");
  SftExample expected;
  auto header = [&](const std::string& role) {
    add_token(expected, kHeader, false);
    add_text(expected, role, false);
    add_token(expected, kEndHeader, false);
    add_text(expected, "\n\n", false);
  };
  header("system"), add_text(expected, "Be brief.", false), add_token(expected, kEot, false);
  header("user"), add_text(expected, "Hi?", false), add_token(expected, kEot, false);
  header("assistant"), add_text(expected, "Hello!", true), add_token(expected, kEot, true);
  header("user"), add_text(expected, "2+2", false), add_token(expected, kEot, false);
  header("assistant"), add_text(expected, "4", true), add_token(expected, kEot, true);
  expected.trained.push_back(0);  // the EOS after a chat: the packer's boundary, not an answer
  const SftExample got = renderer.encode(kChat, "chat.jsonl:1");
  EXPECT_EQ(got.tokens, expected.tokens);
  EXPECT_EQ(got.trained, expected.trained);
}

TEST(Sft, ChatMLRendersLikeTheHfTemplateAndTrainsAnswersOnly) {
  const Tokenizer tok = chatml_tokenizer();
  const SftRenderer renderer(tok, {});
  ASSERT_EQ(renderer.chat_template(), ChatTemplate::kChatML);
  // The ChatML template keeps the content as written.
  EXPECT_EQ(joined(renderer.render(kChat, "chat.jsonl:1")),
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\n  Hi?\n<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\n\u001f2+2\u3000<|im_end|>\n"
            "<|im_start|>assistant\n 4 \n<|im_end|>\n");
  SftExample expected;
  auto turn = [&](const std::string& role, const std::string& content) {
    const bool answer = role == "assistant";
    add_token(expected, kImStart, false);
    add_text(expected, role + "\n", false);
    add_text(expected, content, answer);
    add_token(expected, kImEnd, answer);
    add_text(expected, "\n", false);  // after <|im_end|>: masked
  };
  turn("system", "Be brief.");
  turn("user", "  Hi?\n");
  turn("assistant", "Hello!");
  turn("user", "\u001f2+2\u3000");
  turn("assistant", " 4 \n");
  expected.trained.push_back(0);
  const SftExample got = renderer.encode(kChat, "chat.jsonl:1");
  EXPECT_EQ(got.tokens, expected.tokens);
  EXPECT_EQ(got.trained, expected.trained);
}

// Each side of the mask is tokenized on its own: a merge that would span the prompt's end and the
// completion's start ("a" + "b" -> "ab") does not happen, so no token is half prompt, half answer.
TEST(Sft, PromptCompletionTrainsTheCompletionAndItsEos) {
  // A tokenizer with the merge a + b -> "ab" (id 258).
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[loom::data::byte_level::to_alphabet(std::string(1, static_cast<char>(b)))] = b;
  vocab["ab"] = 258;
  const json tj = {{"version", "1.0"},
                   {"added_tokens", json::array({{{"id", 256}, {"content", "<|begin_of_text|>"}, {"special", true}},
                                                 {{"id", 257}, {"content", "<|end_of_text|>"}, {"special", true}}})},
                   {"normalizer", nullptr},
                   {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                   {"decoder", {{"type", "ByteLevel"}}},
                   {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"a b"})}}}};
  const Tokenizer tok = Tokenizer::from_json_string(tj.dump(), "merges.json");
  ASSERT_EQ(tok.encode("xab"), (std::vector<int64_t>{'x', 258}));
  const json pair = {{"prompt", "Q: xa"}, {"completion", "b"}};
  const SftRenderer renderer(tok, {});
  EXPECT_FALSE(renderer.chat_template().has_value());  // no chat tokens: only pairs can be read
  const SftExample e = renderer.encode(pair, "pairs.jsonl:1");
  EXPECT_EQ(e.tokens, (std::vector<int64_t>{'Q', ':', ' ', 'x', 'a', 'b'}));
  EXPECT_EQ(e.trained, (std::vector<uint8_t>{0, 0, 0, 0, 0, 1, 1}));  // "b", then the EOS

  // train_on_prompt: the same tokens, every one trained.
  const SftRenderer all(tok, {ChatTemplate::kAuto, /*train_on_prompt=*/true});
  const SftExample a = all.encode(pair, "pairs.jsonl:1");
  EXPECT_EQ(a.tokens, e.tokens);
  EXPECT_EQ(a.trained, std::vector<uint8_t>(7, 1));
}

TEST(Sft, TrainOnPromptKeepsTheChatTokensAndTrainsThemAll) {
  const Tokenizer tok = llama3_tokenizer();
  const SftExample masked = SftRenderer(tok, {}).encode(kChat, "c:1");
  const SftExample all = SftRenderer(tok, {ChatTemplate::kLlama3, true}).encode(kChat, "c:1");
  EXPECT_EQ(all.tokens, masked.tokens);
  EXPECT_EQ(all.trained, std::vector<uint8_t>(masked.tokens.size() + 1, 1));
}

TEST(Sft, TemplateChoiceAndMissingSpecialTokens) {
  const Tokenizer llama = llama3_tokenizer();
  const Tokenizer chatml = chatml_tokenizer();
  EXPECT_EQ(SftRenderer(chatml, {ChatTemplate::kChatML}).chat_template(), ChatTemplate::kChatML);
  // A template the tokenizer cannot encode: the first conversation fails, naming its line, what is
  // missing and the way out (here the tokenizer's own template).
  const SftRenderer wrong(chatml, {ChatTemplate::kLlama3});
  EXPECT_FALSE(wrong.chat_template().has_value());
  loom::testing::expect_error<loom::UsageError>(
      [&] { wrong.encode(kChat, "chat.jsonl:3"); },
      {"chat.jsonl:3: ", "sft.chat_template = \"llama3\" needs the special tokens <|start_header_id|>, "
                         "<|end_header_id|>, <|eot_id|>",
       "tiny.json", "set sft.chat_template = \"chatml\""});
  // Neither template's tokens: auto asks for the chat tokenizer or an explicit template.
  const Tokenizer plain = byte_tokenizer({"<|begin_of_text|>", "<|end_of_text|>"});
  loom::testing::expect_error<loom::UsageError>(
      [&] { SftRenderer(plain, {}).encode(kChat, "chat.jsonl:1"); },
      {"chat.jsonl:1: ", "neither the Llama 3 chat tokens", "sft.chat_template = \"auto\"",
       "set sft.chat_template to \"llama3\" or \"chatml\""});
  // A template token only in the BPE vocabulary (not an added token) would be split when the text
  // is encoded, so it counts as missing.
  const Tokenizer vocab_only = byte_tokenizer(
      {"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"}, {"<|eot_id|>"});
  ASSERT_GE(vocab_only.token_to_id("<|eot_id|>"), 0);
  loom::testing::expect_error<loom::UsageError>(
      [&] { SftRenderer(vocab_only, {ChatTemplate::kLlama3}).encode(kChat, "c.jsonl:9"); },
      {"c.jsonl:9: ", "needs the special token <|eot_id|> but", "does not encode it as single tokens"});
  // Prompt/completion lines need no template.
  EXPECT_EQ(SftRenderer(plain, {}).encode({{"prompt", "a"}, {"completion", "b"}}, "p:1").tokens,
            (std::vector<int64_t>{'a', 'b'}));
}

TEST(Sft, BadLinesAreOneLineErrorsNamingFileAndLine) {
  const auto dir = loom::testing::temp_dir();
  const Tokenizer tok = llama3_tokenizer();
  const std::string ok = R"({"prompt": "p", "completion": "c"})";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {R"({"text": "plain"})", {"neither \"prompt\"/\"completion\" nor \"messages\"", "{\"prompt\": "}},
      {R"({"prompt": "p"})", {"the line has no \"completion\""}},
      {R"({"prompt": "p", "completion": 3})", {"the line has a number \"completion\", not a string"}},
      {R"({"prompt": "p", "completion": "c", "messages": []})", {"both \"messages\" and \"prompt\"/\"completion\""}},
      {R"({"messages": "hi"})", {"\"messages\" is a string, not a list of messages"}},
      {R"({"messages": []})", {"\"messages\" is empty"}},
      {R"({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]})",
       {"message 1 has role \"tool\"", "\"system\", \"user\" and \"assistant\""}},
      {R"({"messages": [{"role": "assistent", "content": "x"}]})", {"(did you mean \"assistant\"?)"}},
      {R"({"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]})", {"message 1 has no \"content\""}},
      {R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})",
       {"no \"assistant\" message", "drop the line"}},
      {R"(["prompt", "completion"])", {"a JSON array, not an object"}},
  };
  for (const auto& [line, parts] : cases) {
    SCOPED_TRACE(line);
    const fs::path file = dir / "bad.jsonl";
    // The bad line is line 3: a valid line and a blank one come first.
    loom::testing::write(file, ok + "\n\n" + line + "\n" + ok + "\n");
    std::vector<std::string> expected = parts;
    expected.push_back(file.string() + ":3: ");
    loom::testing::expect_error<loom::UsageError>([&] { examples_of(file, tok); }, expected);
  }
  // Not JSON at all: the JSONL reader's error, naming the line and the configured format.
  loom::testing::write(dir / "text.jsonl", ok + "\nnot json\n");
  loom::testing::expect_error([&] { examples_of(dir / "text.jsonl", tok); },
                              {"text.jsonl:2: not valid JSON", "training.dataset_format is \"sft\""});
}

// The loader keeps each example's mask: labels are the next token where it is trained and -100
// elsewhere, the label that predicts the next example's BOS included, across row boundaries;
// document ids and positions are those of unmasked data.
TEST(Sft, PackedRowsMaskEveryUntrainedLabel) {
  const auto dir = loom::testing::temp_dir();
  const Tokenizer tok = llama3_tokenizer();
  const fs::path file = dir / "chat.jsonl";
  loom::testing::write(file, kChat.dump() + "\n" +
                                 R"({"prompt": "Name a colour:", "completion": " red"})" + "\n" +
                                 R"({"messages": [{"role": "user", "content": "Yes?"}, {"role": "assistant", "content": "No."}]})" +
                                 "\n");
  const std::vector<SftExample> examples = examples_of(file, tok);
  ASSERT_EQ(examples.size(), 3u);
  // The packed stream and each token's trained flag: BOS (never trained) + tokens + EOS.
  std::vector<int64_t> stream, doc_of;
  std::vector<uint8_t> trained;
  for (size_t d = 0; d < examples.size(); ++d) {
    stream.push_back(kL3Bos);
    trained.push_back(0);
    stream.insert(stream.end(), examples[d].tokens.begin(), examples[d].tokens.end());
    stream.push_back(kL3Eos);
    trained.insert(trained.end(), examples[d].trained.begin(), examples[d].trained.end());
    doc_of.insert(doc_of.end(), examples[d].tokens.size() + 2, static_cast<int64_t>(d));
  }
  loom::data::SourceOptions options = sft_options();
  const auto corpus = loom::data::TokenCorpus::load({file.string()}, &tok, options);
  ASSERT_TRUE(corpus->masked());
  EXPECT_EQ(corpus->num_documents(), 3);
  EXPECT_EQ(corpus->stream_length(), static_cast<int64_t>(stream.size()));
  int64_t trained_count = 0;
  for (uint8_t t : trained) trained_count += t;
  EXPECT_EQ(corpus->num_trained_tokens(), trained_count);
  // The pair's EOS is trained, the chats' are not.
  EXPECT_EQ(examples[1].trained.back(), 1);
  EXPECT_EQ(examples[0].trained.back(), 0);

  const int64_t seq_len = 13;  // rows start mid-example and span example boundaries
  const loom::data::SequencePacker packer(corpus, seq_len);
  const int64_t rows = packer.rows_per_epoch();
  ASSERT_EQ(rows, static_cast<int64_t>(stream.size()) / (seq_len + 1));
  const loom::data::Batch batch = packer.read_rows(0, rows);
  int64_t masked_bos_labels = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * (seq_len + 1);
    for (int64_t t = 0; t < seq_len; ++t) {
      const int64_t next = base + t + 1;
      EXPECT_EQ(batch.inputs[r][t].item<int64_t>(), stream[base + t]);
      EXPECT_EQ(batch.labels[r][t].item<int64_t>(), trained[next] ? stream[next] : loom::data::kIgnoreIndex)
          << "row " << r << " position " << t;
      EXPECT_EQ(batch.document_ids[r][t].item<int64_t>(), doc_of[base + t] - doc_of[base]);
      if (stream[next] == kL3Bos) {
        ++masked_bos_labels;
        EXPECT_EQ(batch.labels[r][t].item<int64_t>(), loom::data::kIgnoreIndex);
      }
    }
  }
  EXPECT_GE(masked_bos_labels, 1);  // a row holds an example boundary
}

// An unmasked corpus reports every token trained; its labels are untouched by the masking path.
TEST(Sft, UnmaskedCorporaTrainEveryLabel) {
  const auto corpus = loom::data::TokenCorpus::from_documents({{1, 2, 3}, {4, 5}}, 100, 101);
  EXPECT_FALSE(corpus->masked());
  EXPECT_EQ(corpus->num_trained_tokens(), 7);  // 5 tokens and 2 EOS
  std::vector<int64_t> tokens(9), positions(9), docs(9);
  std::vector<uint8_t> trained(9, 7);
  corpus->read_stream(0, 9, tokens.data(), positions.data(), docs.data(), trained.data());
  EXPECT_EQ(trained, std::vector<uint8_t>(9, 1));
  const loom::data::Batch b = loom::data::SequencePacker(corpus, 8).read_rows(0, 1);
  EXPECT_TRUE(torch::equal(b.labels[0], torch::tensor({1, 2, 3, 101, 100, 4, 5, 101}, torch::kInt64)));
}

// Examples packed with from_examples read back as load() packs them; a row whose every label is
// masked is counted in a warning at load (its batch would have no loss to average).
TEST(Sft, RowsWithoutTrainedLabelsAreReported) {
  // A prompt of 10 tokens, an answer of 2 and the EOS: rows of 7 are BOS 1..6 and 7..12 EOS.
  SftExample long_prompt;
  long_prompt.tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  long_prompt.trained = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1};
  const auto corpus = loom::data::TokenCorpus::from_examples({long_prompt}, 100, 101);
  EXPECT_EQ(corpus->num_trained_tokens(), 3);
  ::testing::internal::CaptureStderr();
  const loom::data::SequencePacker packer(corpus, 6, "training.seq_len");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("1 of the 2 rows of the corpus have no trained label"), std::string::npos) << err;
  EXPECT_NE(err.find("use a longer training.seq_len"), std::string::npos) << err;
  const loom::data::Batch b = packer.read_rows(0, 2);
  EXPECT_TRUE(torch::equal(b.labels, torch::tensor({-100, -100, -100, -100, -100, -100, -100, -100, -100, 11, 12, 101},
                                                   torch::kInt64)
                                         .reshape({2, 6})))
      << b.labels;
}

// The token cache keeps ids, not masks: sft files are rendered at every load and never cached; a
// token file given as sft, and sft given to the text reader, are one-line errors.
TEST(Sft, NeverCachedAndOnlyTheLoaderReadsIt) {
  const auto dir = loom::testing::temp_dir();
  const Tokenizer tok = llama3_tokenizer();
  const fs::path file = dir / "chat.jsonl";
  loom::testing::write(file, kChat.dump() + "\n");
  loom::data::SourceOptions options = sft_options();
  options.token_cache_dir = (dir / "cache").string();
  const auto corpus = loom::data::TokenCorpus::load({file.string()}, &tok, options);
  EXPECT_TRUE(corpus->masked());
  EXPECT_FALSE(fs::exists(dir / "cache"));
  EXPECT_EQ(loom::data::source_format(loom::data::DatasetFormat::kSft), loom::data::SourceFormat::kSft);
  loom::testing::expect_error<loom::UsageError>(
      [&] { loom::data::for_each_text_document(file.string(), options, [](std::string_view) {}); },
      {"chat.jsonl' is read as sft data (training.dataset_format)", "use \"jsonl\""});
  loom::data::TokenFileWriter writer((dir / "t.tokens").string(), tok.vocab_size(), tok.bos_id(), tok.eos_id());
  writer.add_document({1, 2});
  writer.close();
  loom::testing::expect_error<loom::UsageError>(
      [&] { loom::data::TokenCorpus::load({(dir / "t.tokens").string()}, &tok, options); },
      {"is a loom token file but training.dataset_format is \"sft\""});
}

}  // namespace sft_test
