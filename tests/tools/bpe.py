"""Small byte-level BPE tokenizers for the tiny test checkpoints and the demo model, trained here and
written as a Qwen3.5 checkpoint holds them (tokenizer.json, tokenizer_config.json, the chat template).
The engine only reads tokenizers (engine/tokenizer.py); nothing here ships with it.
"""
from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

from mtpchat.engine.tokenizer import BUNDLED_TEMPLATE, CONFIG_FILE, QWEN_ADDED_TOKENS, TEMPLATE_FILE, TOKENIZER_FILE

# In the spirit of Qwen3.5's pre-tokenizer: letters with their combining marks, single digits,
# punctuation runs, newline runs, and whitespace that leaves one space to the following word.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{M}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE with Qwen's added tokens; `vocab_size` counts them and is an upper bound."""
    n_bpe = vocab_size - len(QWEN_ADDED_TOKENS)
    if n_bpe < 256:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs 256 + "
                         f"{len(QWEN_ADDED_TOKENS)} ids at least.")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # Added after training so their ids follow the BPE vocabulary, as in Qwen's checkpoints.
    for content, special in QWEN_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


def write_tokenizer_files(folder: str | Path, tokenizer: tokenizers.Tokenizer) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja, laid out like a Qwen3.5 checkpoint."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / TOKENIZER_FILE))
    added = sorted(tokenizer.get_added_tokens_decoder().items())
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in added
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    shutil.copyfile(BUNDLED_TEMPLATE, folder / TEMPLATE_FILE)
    return {content: tokenizer.token_to_id(content) for content, _ in QWEN_ADDED_TOKENS}


_WORDS = ("the model reads every token and writes the next one while a small head guesses a few more "
          "tokens ahead so the large model can check them all at once and keep the ones it agrees with "
          "state cache layer memory speed answer question think about this carefully please thank you "
          "hello world yes no maybe because first then finally river mountain city garden kitchen window "
          "morning evening winter summer music story number letter picture system function variable string "
          "quickly slowly brightly quietly happily strange simple complex ancient modern green purple orange "
          "travel remember explain compare measure build break follow return print count sort search").split()
_EXTRA = ["café", "naïve", "résumé", "Zürich", "東京", "こんにちは", "数学", "Привет", "γλώσσα", "🙂", "🚀", "👍🏽", "∑", "→"]
_CODE = ["def f(x):\n    return x * 2\n", "for i in range(10):\n    print(i)\n", "if (a < b) { return 0; }\n"]


def default_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Deterministic generated text (English words, numbers, code, non-ASCII words and emoji) for tiny tokenizers."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(_EXTRA) if rng.random() < 0.12 else rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"])
        if i % 7 == 0:
            sentence += "\n\n" + rng.choice(_CODE)
        out.append(sentence)
    return out
