"""A weight-less Llama-3.1-8B model folder for vLLM's `--load-format dummy`: config, tokenizer, template.

usage: python make_model.py OUT_DIR WORDS_FILE

The tokenizer is one token per word (WordLevel over whitespace-split words). Ids 1..N are the
benchmark's own words (WORDS_FILE: `bench.text.vocabulary()`, one per line, written by
build_payload.sh), so a benchmark prompt of N words is exactly N engine tokens, as it is N tokens
of the gateway's cl100k: Llama 3's tokenizer also keeps common lowercase words whole. The rest of
the 128,256 ids are filler words `tNNNN` and Llama 3's special tokens. Runs with Python 3.12 and
`tokenizers` only (the GPU host's version, 0.23.2).
"""

import json
import os
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

VOCAB_SIZE = 128256
FIRST_SPECIAL = 128000
SPECIAL = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128008: "<|eom_id|>",
    128009: "<|eot_id|>",
}
# Role names the chat template writes as words: they must be real tokens, not <unk>.
ROLES = ("system", "user", "assistant")
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> "
    "{{ m['content'] }} <|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|>{% endif %}"
)
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": VOCAB_SIZE,
}


def vocabulary(words_file: str) -> dict[str, int]:
    with open(words_file) as f:
        words = [w.strip() for w in f if w.strip()]
    words += [r for r in ROLES if r not in words]
    if len(words) >= FIRST_SPECIAL - 1:
        raise SystemExit(f"{len(words)} words do not fit below the special tokens")
    vocab = {"<unk>": 0}
    for w in words:
        vocab.setdefault(w, len(vocab))
    for i in range(len(vocab), FIRST_SPECIAL):
        vocab[f"t{i}"] = i
    return vocab


def main(out: str, words_file: str) -> None:
    os.makedirs(out, exist_ok=True)
    vocab = vocabulary(words_file)
    names = {
        i: SPECIAL.get(i, f"<|reserved_special_token_{i - FIRST_SPECIAL}|>")
        for i in range(FIRST_SPECIAL, VOCAB_SIZE)
    }
    vocab.update({name: i for i, name in names.items()})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([AddedToken(names[i], special=True, normalized=False) for i in sorted(names)])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    probe = " system user assistant " + " ".join(list(vocab)[1:6])
    assert 0 not in tok.encode(probe).ids, "a benchmark word maps to <unk>"
    tok.save(os.path.join(out, "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL[128000],
        "eos_token": SPECIAL[128001],
        "unk_token": "<unk>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "chat_template": TEMPLATE,
    }
    files = {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": {
            "bos_token": SPECIAL[128000],
            "eos_token": SPECIAL[128001],
            "unk_token": "<unk>",
        },
        "config.json": LLAMA_8B,
        "generation_config.json": {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    }
    for name, doc in files.items():
        with open(os.path.join(out, name), "w") as f:
            json.dump(doc, f, indent=1)
    print(f"model folder {out}: {VOCAB_SIZE} token ids, words of {words_file} first")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
