"""SFT masking: the loss of `loom train` on chat data equals a Python reference that masks the
prompt tokens.

A hand-made JSONL file mixes multi-turn chats (system, user and assistant messages, a user turn
after the last answer, content with whitespace the Llama 3 template strips) and prompt/completion
pairs. A byte-level BPE tokenizer with the Llama 3 and ChatML special tokens is trained on it with
Hugging Face `tokenizers`, and a small random LlamaForCausalLM (Loom's "tiny" flavor, 2 layers) is
saved with save_pretrained. `loom train` runs one step from it (checkpoint.initial_load_path,
training.dataset_format = "sft", block-causal attention, every row of the file in the one batch),
once per template. The reference, built independently of Loom:
  * chats: transformers' apply_chat_template with the template written as a Jinja string (the
    Llama 3 Instruct / ChatML text, with {% generation %} around each answer and its end-of-turn
    token), whose assistant_masks mark the trained tokens; pairs: the prompt's and the
    completion's tokens, the completion trained;
  * packing as Loom documents it: BOS + example + EOS (the EOS trained after a completion, not
    after a chat; the label of the next BOS masked), cut into rows of seq_len + 1;
  * block-causal attention: each document's piece of a row run through the model on its own;
  * mean cross-entropy over the labels not masked.
Checked in fp32: the step-1 loss in metrics.jsonl equals the reference within 1e-5 relative, and
the references for what a bug would compute (no mask, the mask off by one token, documents of a row
attending to each other) all miss it by more than 100 times that. The same file as validation data
(optimizer.lr = 0, so step 1 leaves the weights as loaded), scored in uneven batches of 3 rows,
gives the same loss (validation weighs each batch by its trained tokens) and counts exactly the
trained labels. Also: a line with an unknown role stops `loom train` with exit code 2 and one line
naming file:line.

Environment (set by ctest): LOOM_BIN. Exits non-zero on any mismatch.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

LOOM_BIN = os.environ.get("LOOM_BIN", "build/bin/loom")
RELATIVE_TOLERANCE = 1e-5
SEQ_LEN = 48
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]

# Meta-Llama-3-Instruct's template and the ChatML template, each answer wrapped in {% generation %}
# so transformers reports which tokens are the assistant's (the rendered text is unchanged).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}{% endfor %}")

EXAMPLES = [
    {"messages": [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome is the capital of Italy."}]},
    {"prompt": "Translate to German: good morning\nGerman:", "completion": " Guten Morgen"},
    {"messages": [
        {"role": "user", "content": "  Add 12 and 30, please.  "},
        {"role": "assistant", "content": "\n12 + 30 = 42.\n"}]},
    {"messages": [
        {"role": "system", "content": "Answer with a single word."},
        {"role": "user", "content": "Colour of the sky on a clear day?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Thanks!"}]},
    {"prompt": "Q: How many legs does a spider have?\nA:", "completion": " Eight legs."},
    {"messages": [
        {"role": "user", "content": "Write a haiku about rain."},
        {"role": "assistant", "content": "Soft rain on the roof,\nthe garden drinks, slow and deep;\nmorning smells of earth."}]},
    {"messages": [
        {"role": "system", "content": "You help with cooking."},
        {"role": "user", "content": "How long do I boil an egg for a runny yolk?"},
        {"role": "assistant", "content": "About six minutes, then cool it in cold water."},
        {"role": "user", "content": "And hard boiled?"},
        {"role": "assistant", "content": "Ten to twelve minutes."}]},
    {"prompt": "Complete the list: red, green,", "completion": " blue."},
]


def texts_of(example):
    if "messages" in example:
        return [m["content"] for m in example["messages"]]
    return [example["prompt"], example["completion"]]


def make_tokenizer(path):
    """A Llama 3-style byte-level BPE (its pre-tokenizer regex) trained on the examples."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([t for e in EXAMPLES for t in texts_of(e)], trainer)
    tok.save(path)
    return PreTrainedTokenizerFast(tokenizer_file=path, bos_token=BOS, eos_token=EOS)


def make_model(vocab_size, path):
    """Loom's llama3 "tiny" flavor with 2 layers, random weights large enough for O(1) logits."""
    config = LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=vocab_size, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.12))
        # A sharp output head spreads the per-token losses widely, so the mean over a wrongly
        # chosen set of tokens (a mask off by one) lands far from the right one.
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(path)
    return model


def reference_documents(hf_tok, template):
    """Each example as (token ids without BOS, trained flag per token and one for the EOS)."""
    docs = []
    bos_id = hf_tok.convert_tokens_to_ids(BOS)
    for e in EXAMPLES:
        if "messages" in e:
            out = hf_tok.apply_chat_template(e["messages"], chat_template=template, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
            if ids[0] == bos_id:  # Llama 3's template starts with the BOS Loom's packer adds
                ids, mask = ids[1:], mask[1:]
            docs.append((ids, mask + [0]))
        else:
            prompt = hf_tok.encode(e["prompt"], add_special_tokens=False)
            completion = hf_tok.encode(e["completion"], add_special_tokens=False)
            docs.append((prompt + completion, [0] * len(prompt) + [1] * len(completion) + [1]))
    return docs


def reference_rows(hf_tok, docs):
    """The packed stream cut into rows: {inputs, labels (masked ones -100), and two wrong label sets
    the check must tell apart: every label, and the mask off by one (the input token's flag)}."""
    bos, eos = hf_tok.convert_tokens_to_ids(BOS), hf_tok.convert_tokens_to_ids(EOS)
    stream, trained = [], []
    for ids, flags in docs:
        stream += [bos] + ids + [eos]
        trained += [0] + flags
    rows = len(stream) // (SEQ_LEN + 1)
    out = []
    for r in range(rows):
        row = stream[r * (SEQ_LEN + 1):(r + 1) * (SEQ_LEN + 1)]
        flags = trained[r * (SEQ_LEN + 1):(r + 1) * (SEQ_LEN + 1)]
        out.append({"inputs": row[:-1],
                    "masked": [t if f else -100 for t, f in zip(row[1:], flags[1:])],
                    "unmasked": row[1:],
                    "off by one": [t if f else -100 for t, f in zip(row[1:], flags[:-1])]})
    return out


def reference_losses(model, rows, bos):
    """Mean cross-entropy over each label set's kept labels, each document of a row attending only
    to itself (block-causal), by label set."""
    logits = []
    with torch.no_grad():
        for row in rows:
            inputs = row["inputs"]
            starts = [0] + [i for i in range(1, len(inputs)) if inputs[i] == bos] + [len(inputs)]
            for a, b in zip(starts, starts[1:]):
                logits.append(model(torch.tensor([inputs[a:b]])).logits[0].to(torch.float32))
        # Plain causal attention over the whole row: what a loader that lost the documents gives.
        causal = torch.cat([model(torch.tensor([row["inputs"]])).logits[0].to(torch.float32) for row in rows])

    def loss(logits, key):
        labels = torch.tensor([l for r in rows for l in r[key]])
        return torch.nn.functional.cross_entropy(logits.double(), labels, ignore_index=-100).item()

    logits = torch.cat(logits)
    out = {key: loss(logits, key) for key in ("masked", "unmasked", "off by one")}
    out["causal"] = loss(causal, "masked")
    return out


def run_loom(workdir, name, tokenizer, hf_dir, data, rows, extra):
    folder = os.path.join(workdir, name)
    config = os.path.join(workdir, name + ".toml")
    with open(config, "w") as f:
        f.write(f"""
[job]
dump_folder = "{folder}"
[model]
name = "llama3"
flavor = "tiny"
n_layers = 2
tokenizer_path = "{tokenizer}"
attention_mask = "block_causal"
[training]
dataset_path = "{data}"
dataset_format = "sft"
token_cache = false
seq_len = {SEQ_LEN}
local_batch_size = {rows}
steps = 1
deterministic = true
[metrics]
log_freq = 1
peak_flops = 1e12
memory_breakdown = false
[checkpoint]
initial_load_path = "{hf_dir}"
[optimizer]
lr = 0.0
[validation]
enable = true
dataset_path = "{data}"
dataset_format = "sft"
freq = 1
local_batch_size = 3
""")
    proc = subprocess.run([LOOM_BIN, "train", "--config", config, *extra], capture_output=True, text=True)
    return proc, folder


def step_one(folder, key):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record.get("step") == 1 and key in record:
                return record[key]
    sys.exit(f"no step-1 {key} in {folder}/metrics.jsonl")


def main():
    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    failures = []
    with tempfile.TemporaryDirectory(prefix="loom_sft_") as workdir:
        tokenizer_path = os.path.join(workdir, "tokenizer.json")
        hf_tok = make_tokenizer(tokenizer_path)
        hf_dir = os.path.join(workdir, "hf")
        model = make_model(len(hf_tok), hf_dir)
        data = os.path.join(workdir, "chat.jsonl")
        with open(data, "w") as f:
            for e in EXAMPLES:
                f.write(json.dumps(e) + "\n")
        bos = hf_tok.convert_tokens_to_ids(BOS)

        for name, template, setting in [("llama3", LLAMA3_TEMPLATE, "llama3"), ("chatml", CHATML_TEMPLATE, "chatml")]:
            docs = reference_documents(hf_tok, template)
            rows = reference_rows(hf_tok, docs)
            trained = sum(l != -100 for r in rows for l in r["masked"])
            losses = reference_losses(model, rows, bos)
            expected = losses["masked"]
            proc, folder = run_loom(workdir, name, tokenizer_path, hf_dir, data, len(rows),
                                    [f"--sft.chat_template={setting}"])
            if proc.returncode != 0:
                failures.append(f"{name}: loom train failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
                continue
            got = step_one(folder, "loss")
            relative = abs(got - expected) / abs(expected)
            print(f"{name}: {len(rows)} rows of {SEQ_LEN}, {trained} of {len(rows) * SEQ_LEN} labels trained; "
                  f"step-1 loss loom {got:.8f} reference {expected:.8f} (relative {relative:.1e}); what a bug would give: "
                  f"unmasked {losses['unmasked']:.6f}, off by one {losses['off by one']:.6f}, "
                  f"causal {losses['causal']:.6f}")
            if relative > RELATIVE_TOLERANCE:
                failures.append(f"{name}: loss {got} differs from the masked reference {expected} by {relative:.1e}")
            for wrong in ("unmasked", "off by one", "causal"):
                # The check is only worth its tolerance if a wrong mask misses it by far more.
                if abs(losses[wrong] - expected) / abs(expected) < 100 * RELATIVE_TOLERANCE:
                    failures.append(f"{name}: the {wrong} loss {losses[wrong]} is too close to the masked one "
                                    f"{expected} for the check to tell them apart")
            validation, validation_tokens = step_one(folder, "validation_loss"), step_one(folder, "validation_tokens")
            validation_relative = abs(validation - expected) / abs(expected)
            print(f"{name}: validation loss {validation:.8f} (relative {validation_relative:.1e}) over "
                  f"{validation_tokens:.0f} tokens")
            if validation_relative > RELATIVE_TOLERANCE or validation_tokens != trained:
                failures.append(f"{name}: validation loss {validation} over {validation_tokens} tokens, expected "
                                f"{expected} over {trained}")
            if not 0 < trained < len(rows) * SEQ_LEN:
                failures.append(f"{name}: {trained} trained labels: the file should mix trained and masked tokens")

        # A bad line: one line naming file:line, exit code 2, before any step.
        bad = os.path.join(workdir, "bad.jsonl")
        with open(bad, "w") as f:
            f.write(json.dumps(EXAMPLES[1]) + "\n")
            f.write(json.dumps({"messages": [{"role": "tool", "content": "{}"},
                                             {"role": "assistant", "content": "ok"}]}) + "\n")
        proc, _ = run_loom(workdir, "bad", tokenizer_path, hf_dir, bad, 1, [])
        lines = [l for l in proc.stderr.splitlines() if "bad.jsonl" in l]
        print(f"bad line: exit code {proc.returncode}: {lines[-1] if lines else proc.stderr.strip()}")
        if proc.returncode != 2 or len(lines) != 1 or f"{bad}:2: message 1 has role \"tool\"" not in lines[0]:
            failures.append(f"bad line: expected exit 2 and one line naming {bad}:2, got {proc.returncode}: "
                            f"{proc.stderr.strip()[-2000:]}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
