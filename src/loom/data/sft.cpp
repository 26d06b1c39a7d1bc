#include "loom/data/sft.h"

#include <string_view>

#include "loom/core/error.h"
#include "loom/core/strings.h"
#include "loom/data/byte_level.h"
#include "loom/data/sources.h"

namespace loom::data {

const options::EnumNames<ChatTemplate>& option_names(ChatTemplate) {
  static const options::EnumNames<ChatTemplate> names = {
      {"auto", ChatTemplate::kAuto}, {"llama3", ChatTemplate::kLlama3}, {"chatml", ChatTemplate::kChatML}};
  return names;
}

const options::Section& sft_section() {
  using S = SftConfig;
  static const options::Section section{
      "sft",
      {
          {LOOM_OPTION(S, chat_template),
           "How `messages` conversations are rendered: `llama3` (`<|start_header_id|>role<|end_header_id|>"
           "\\n\\ncontent<|eot_id|>` per message, the content stripped, as Meta-Llama-3-Instruct's template), "
           "`chatml` (`<|im_start|>role\\ncontent<|im_end|>\\n`), or `auto`: `llama3` when the tokenizer has "
           "`<|start_header_id|>`, `<|end_header_id|>` and `<|eot_id|>`, else `chatml` when it has "
           "`<|im_start|>` and `<|im_end|>`. A conversation the template cannot render (no such tokens, or "
           "not single tokens of the tokenizer) is a one-line error naming its file and line. "
           "Prompt/completion lines use no template."},
          {LOOM_OPTION(S, train_on_prompt),
           "Take the loss on every token of each example (system and user turns, headers, prompts) "
           "instead of only the completion / assistant tokens. The tokens are the same either way."},
      },
      R"md(How `sft` data (`training.dataset_format = "sft"`, and `validation.dataset_format`) is
rendered and masked: JSONL lines of `{"prompt": ..., "completion": ...}` or `{"messages": [{"role":
"system" | "user" | "assistant", "content": ...}, ...]}`, the loss on the completion and on assistant
messages with their end-of-turn token only. See docs/lora.md, "SFT data".)md",
      {},
      nullptr};
  return section;
}

namespace {

const std::vector<std::string> kLlama3Tokens = {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
const std::vector<std::string> kChatMLTokens = {"<|im_start|>", "<|im_end|>"};

// The template's special tokens that the tokenizer does not encode as one id of their own, in the
// order the template names them. A token present only in the BPE vocabulary (not an added token)
// would be split into pieces when the rendered text is encoded, so it counts as missing.
std::vector<std::string> missing_tokens(const Tokenizer& tokenizer, const std::vector<std::string>& tokens) {
  std::vector<std::string> missing;
  for (const std::string& token : tokens) {
    const int64_t id = tokenizer.token_to_id(token);
    if (id < 0 || tokenizer.encode(token) != std::vector<int64_t>{id}) missing.push_back(token);
  }
  return missing;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// Python's str.isspace, which Jinja's `trim` (str.strip) removes: Unicode White_Space plus the
// four information separators U+001C..U+001F.
bool python_space(char32_t c) { return unicode::is_whitespace(c) || (c >= 0x1C && c <= 0x1F); }

// Jinja's `trim` filter, which the Llama 3 template applies to every message's content.
std::string strip(std::string_view text) {
  size_t begin = 0, length = 0;
  while (begin < text.size() && python_space(unicode::decode_utf8(text, begin, &length))) begin += length;
  size_t end = text.size();
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    if (!python_space(unicode::decode_utf8(text, start, &length))) break;
    end = start;
  }
  return std::string(text.substr(begin, end - begin));
}

const std::string kShapes =
    "each line of sft data is {\"prompt\": \"...\", \"completion\": \"...\"} or {\"messages\": [{\"role\": "
    "\"system\" | \"user\" | \"assistant\", \"content\": \"...\"}, ...]}";

const std::string& string_field(const nlohmann::json& object, const char* key, const std::string& where,
                                const std::string& what) {
  auto it = object.find(key);
  LOOM_REQUIRE_USAGE(it != object.end() && it->is_string(), where, ": ", what, " has ",
                     it == object.end() ? c10::str("no \"", key, "\"")
                                        : c10::str("a ", it->type_name(), " \"", key, "\", not a string"),
                     "; ", kShapes);
  return it->get_ref<const std::string&>();
}

}  // namespace

SftRenderer::SftRenderer(const Tokenizer& tokenizer, const SftConfig& config)
    : tokenizer_(tokenizer), config_(config) {
  const std::vector<std::string> llama3 = missing_tokens(tokenizer, kLlama3Tokens);
  const std::vector<std::string> chatml = missing_tokens(tokenizer, kChatMLTokens);
  const std::string who = c10::str("tokenizer '", tokenizer.path(), "'");
  switch (config.chat_template) {
    case ChatTemplate::kAuto:
      if (llama3.empty()) {
        template_ = ChatTemplate::kLlama3;
      } else if (chatml.empty()) {
        template_ = ChatTemplate::kChatML;
      } else {
        unusable_ = c10::str(who, " has neither the Llama 3 chat tokens (", joined(kLlama3Tokens),
                             ") nor ChatML's (", joined(kChatMLTokens),
                             ") as special tokens, so sft.chat_template = \"auto\" finds no template for this "
                             "conversation; use the chat model's tokenizer (model.tokenizer_path), or set "
                             "sft.chat_template to \"llama3\" or \"chatml\" with a tokenizer that has its tokens");
      }
      break;
    case ChatTemplate::kLlama3:
    case ChatTemplate::kChatML: {
      const bool is_llama3 = config.chat_template == ChatTemplate::kLlama3;
      const std::vector<std::string>& missing = is_llama3 ? llama3 : chatml;
      const std::vector<std::string>& other = is_llama3 ? chatml : llama3;
      if (missing.empty()) {
        template_ = config.chat_template;
      } else {
        unusable_ = c10::str("sft.chat_template = \"", options::enum_name(config.chat_template), "\" needs ",
                             missing.size() == 1 ? "the special token " : "the special tokens ", joined(missing),
                             " but ", who, " does not encode ", missing.size() == 1 ? "it" : "them",
                             " as single tokens; use the chat model's tokenizer (model.tokenizer_path)",
                             other.empty() ? c10::str(" or set sft.chat_template = \"",
                                                      is_llama3 ? "chatml" : "llama3", "\" (this tokenizer's)")
                                           : std::string());
      }
      break;
    }
  }
}

std::vector<SftSegment> SftRenderer::render(const nlohmann::json& record, const std::string& where) const {
  LOOM_REQUIRE_USAGE(record.is_object(), where, ": a JSON ", record.type_name(), ", not an object; ", kShapes);
  const bool has_messages = record.contains("messages");
  const bool has_pair = record.contains("prompt") || record.contains("completion");
  LOOM_REQUIRE_USAGE(has_messages || has_pair, where, ": neither \"prompt\"/\"completion\" nor \"messages\"; ",
                     kShapes);
  LOOM_REQUIRE_USAGE(!(has_messages && has_pair), where,
                     ": both \"messages\" and \"prompt\"/\"completion\"; keep one of the two forms per line");
  std::vector<SftSegment> out;
  if (has_pair) {
    // No template: the prompt's tokens, then the completion's.
    out.push_back({string_field(record, "prompt", where, "the line"), false});
    out.push_back({string_field(record, "completion", where, "the line"), true});
    return out;
  }
  const nlohmann::json& messages = record.at("messages");
  LOOM_REQUIRE_USAGE(messages.is_array() && !messages.empty(), where, ": \"messages\" is ",
                     messages.is_array() ? "empty" : c10::str("a ", messages.type_name()),
                     ", not a list of messages; ", kShapes);
  bool has_assistant = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::json& m = messages[i];
    const std::string what = c10::str("message ", i + 1);
    LOOM_REQUIRE_USAGE(m.is_object(), where, ": ", what, " is a JSON ", m.type_name(), ", not an object; ", kShapes);
    const std::string& role = string_field(m, "role", where, what);
    LOOM_REQUIRE_USAGE(role == "system" || role == "user" || role == "assistant", where, ": ", what,
                       " has role \"", excerpt(role), "\"; sft data takes \"system\", \"user\" and \"assistant\"",
                       " (did you mean \"", options::nearest(role, {"system", "user", "assistant"}), "\"?)");
    string_field(m, "content", where, what);
    has_assistant = has_assistant || role == "assistant";
  }
  LOOM_REQUIRE_USAGE(has_assistant, where, ": the conversation has no \"assistant\" message, so nothing in it "
                     "would be trained; add the answer, or drop the line");
  LOOM_REQUIRE_USAGE(template_.has_value(), where, ": ", unusable_);
  for (const nlohmann::json& m : messages) {
    const std::string& role = m.at("role").get_ref<const std::string&>();
    const std::string& content = m.at("content").get_ref<const std::string&>();
    const bool assistant = role == "assistant";
    if (*template_ == ChatTemplate::kLlama3) {
      out.push_back({c10::str("<|start_header_id|>", role, "<|end_header_id|>\n\n"), false});
      out.push_back({strip(content), assistant});
      out.push_back({"<|eot_id|>", assistant});
    } else {
      out.push_back({c10::str("<|im_start|>", role, "\n"), false});
      out.push_back({content, assistant});
      out.push_back({"<|im_end|>", assistant});
      out.push_back({"\n", false});
    }
  }
  return out;
}

SftExample SftRenderer::encode(const nlohmann::json& record, const std::string& where) const {
  const std::vector<SftSegment> segments = render(record, where);
  // A chat ends at its last end-of-turn token; the EOS after it is the packer's document boundary,
  // not something the model should learn to emit. A completion is followed by EOS, as in
  // pretraining, so the model learns where a completion ends.
  const bool eos_trained = config_.train_on_prompt || !record.contains("messages");
  SftExample example;
  for (size_t i = 0; i < segments.size();) {
    // A run of pieces with one flag, tokenized as one text: the cuts are exactly the mask's.
    std::string run;
    const bool trained = segments[i].trained;
    for (; i < segments.size() && segments[i].trained == trained; ++i) run += segments[i].text;
    const std::vector<int64_t> ids = tokenizer_.encode(run);
    example.tokens.insert(example.tokens.end(), ids.begin(), ids.end());
    example.trained.insert(example.trained.end(), ids.size(), trained || config_.train_on_prompt ? 1 : 0);
  }
  example.trained.push_back(eos_trained ? 1 : 0);
  return example;
}

void for_each_sft_example(const std::string& path, const SourceOptions& options, const SftRenderer& renderer,
                          const std::function<void(const SftExample&)>& fn) {
  for_each_jsonl_record(path, options, [&](const nlohmann::json& record, int64_t line_no) {
    fn(renderer.encode(record, c10::str(path, ":", line_no)));
  });
}

}  // namespace loom::data
