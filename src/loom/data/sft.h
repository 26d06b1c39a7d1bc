// Supervised fine-tuning (SFT) data: JSONL whose lines are prompt/completion pairs or chat
// conversations, tokenized with a mask that keeps the loss on the answers only.
//
// Each non-blank line of an `sft` file (training.dataset_format = "sft") is one example, either
//   {"prompt": "...", "completion": "..."}
//       the prompt's tokens followed by the completion's (no template: TRL's "standard"
//       prompt-completion format); the completion and the EOS after it are trained;
//   {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
//       rendered with a chat template exactly as the Hugging Face templates render it:
//         llama3  <|start_header_id|>{role}<|end_header_id|>\n\n{content, stripped}<|eot_id|>
//                 per message (Meta-Llama-3-Instruct's template; its leading <|begin_of_text|> is
//                 the BOS the packer puts in front of every document);
//         chatml  <|im_start|>{role}\n{content}<|im_end|>\n per message (the ChatML template);
//       trained: the content of every assistant message and its end-of-turn token (<|eot_id|> /
//       <|im_end|>); masked: system and user messages, every header, ChatML's newline after
//       <|im_end|>, and the EOS the packer appends (a chat ends at its last end-of-turn token).
// With train_on_prompt every token of the example and its EOS are trained instead.
//
// The rendered text is cut where the mask changes and each run is tokenized on its own, so the
// boundary between masked and trained tokens is exact (a BPE merge never straddles it); within a
// run the special tokens encode as single ids, as they do in the Hugging Face tokenizer. The
// packer (loader.h) adds BOS and EOS around every example and masks the label that predicts the
// next example's BOS, so packed examples never train on each other.
//
// Errors (loom::UsageError, exit 2), each one line naming file:line and the fix: a line with
// neither prompt/completion nor messages, a field of the wrong type, an unknown role, a
// conversation without an assistant message, and a conversation when the chat template cannot be
// used (sft.chat_template = "auto" and the tokenizer has neither template's tokens, or the
// template's special tokens are not single tokens of the tokenizer).
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "loom/core/options.h"
#include "loom/data/tokenizer.h"

namespace loom::data {

struct SourceOptions;  // sources.h, which carries an SftConfig

// sft.chat_template.
enum class ChatTemplate {
  kAuto,    // from the tokenizer's special tokens: llama3's, else chatml's
  kLlama3,  // <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
  kChatML,  // <|im_start|>role\ncontent<|im_end|>\n
};
const options::EnumNames<ChatTemplate>& option_names(ChatTemplate);

// The [sft] section of a job config (sft_section() is its schema): how `sft` data is rendered.
struct SftConfig {
  ChatTemplate chat_template = ChatTemplate::kAuto;
  bool train_on_prompt = false;  // true: the loss covers every token, prompts included

  bool operator==(const SftConfig&) const = default;
};
const options::Section& sft_section();

// A piece of an example's rendered text and whether its tokens are trained (before
// train_on_prompt, which does not change the pieces).
struct SftSegment {
  std::string text;
  bool trained = false;
};

// One tokenized example, without BOS/EOS (the packer adds them).
struct SftExample {
  std::vector<int64_t> tokens;
  // One flag per token, then one for the EOS the packer appends after them: 1 = its loss counts.
  std::vector<uint8_t> trained;
};

class SftRenderer {
 public:
  // The template is resolved here (auto: llama3 when the tokenizer has <|start_header_id|>,
  // <|end_header_id|> and <|eot_id|>, else chatml when it has <|im_start|> and <|im_end|>); a
  // template it cannot use is reported at the first conversation, naming its line, so files of
  // prompt/completion pairs need no chat tokens. The tokenizer must outlive the renderer.
  SftRenderer(const Tokenizer& tokenizer, const SftConfig& config);

  // The template conversations are rendered with; nullopt when none can be (see above).
  std::optional<ChatTemplate> chat_template() const { return template_; }

  // The example's text in pieces, in order (their concatenation is what the Hugging Face chat
  // template renders after the BOS); `where` is "file:line" for errors.
  std::vector<SftSegment> render(const nlohmann::json& record, const std::string& where) const;
  // render() tokenized: each run of pieces with one trained flag encoded on its own.
  SftExample encode(const nlohmann::json& record, const std::string& where) const;

 private:
  const Tokenizer& tokenizer_;
  SftConfig config_;
  std::optional<ChatTemplate> template_;
  std::string unusable_;  // why no template can be used (empty when one can)
};

// Calls fn(example) for every non-blank line of an sft file, in file order (JSON errors as
// for_each_jsonl_record's).
void for_each_sft_example(const std::string& path, const SourceOptions& options, const SftRenderer& renderer,
                          const std::function<void(const SftExample&)>& fn);

}  // namespace loom::data
