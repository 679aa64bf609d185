"""A tiny byte-level BPE with DeepSeek-V4's special tokens, trained deterministically in pure Python.

The merges are learnt here (not with `tokenizers`' trainer) so that the vocabulary is exactly
`vocab_size` ids and identical on every run and platform: ties are broken by the pair's text.
Layout: special tokens (BOS 0, EOS 1, ...), then the 256 byte tokens, then merges.
"""

from __future__ import annotations

import random
import string
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜▁pad▁｜>"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads a prompt one token at a time and writes
the next token. The service keeps the state of every request in pages, and each page holds the keys
of a few positions. When a request is finished, its slot and its pages are free again at once.
Hello, world! How are you today? I am fine, thank you. What is the weather like in the city?
It is sunny and warm in the morning, and it will rain in the evening. Please bring an umbrella.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 42. Time flies like an arrow; fruit flies like a
banana. There are many ways to write a sentence, and some of them are better than others.
The attention layer looks at the window of recent tokens and at compressed entries of the past.
Experts in the mixture are chosen by a router, and the shared expert is always on for every token.
Write a short story about a cat who learns to read. Once upon a time, there was a small cat named
Tom. Tom lived in a house with a family who loved books. Every night the children read stories, and
Tom listened. One day he opened a book with his paw and looked at the letters for a long time.
Question: what is the capital of France? Answer: the capital of France is Paris.
def main():\n    print("hello")\n    return 0\n
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def byte_alphabet() -> dict[int, str]:
    """byte -> the character a byte-level BPE piece spells it with (GPT-2's map; DeepSeek's tokenizer too)."""
    return dict(_bytes_to_unicode())


def _train_merges(words: Counter[tuple[str, ...]], n_merges: int) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    words = Counter(words)
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:], strict=False):
                pairs[(a, b)] += c
        if not pairs:
            break
        # Most frequent pair; ties by the pair's text so the result never depends on hash order.
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = best[0] + best[1]
        new: Counter[tuple[str, ...]] = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return merges


def build_tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE of exactly `vocab_size` ids; no BOS is added (the chat format writes it as text)."""
    base = len(SPECIAL_TOKENS) + 256
    if vocab_size < base:
        raise ValueError(f"build_tiny_tokenizer: vocab_size must be >= {base}, got {vocab_size}")
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    b2u = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    corpus = _CORPUS
    if vocab_size - base > 400:  # beyond what the fixed text yields: add fixed pseudo-words
        rng = random.Random(0)
        corpus += " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
                           for _ in range(4 * (vocab_size - base)))
    words = Counter(tuple(w) for w, _ in pre.pre_tokenize_str(corpus))
    merges = _train_merges(words, vocab_size - base)
    if len(merges) != vocab_size - base:
        raise ValueError(f"build_tiny_tokenizer: corpus yields only {base + len(merges)} ids, asked {vocab_size}")
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    # Already in the vocabulary, so they keep ids 0..6; matched whole, never split by BPE.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"tiny tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """tokenizer.json of a model directory, or None when there is none."""
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def tokenizer_config(tok: Tokenizer) -> dict[str, object]:
    """tokenizer_config.json as the release writes it (spec section 5)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
    }
