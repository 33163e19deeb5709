#!/usr/bin/env python3
"""tests/fixtures/wordpiece/: how `transformers` cuts a mixed-script text
into WordPiece ids, cased and uncased, with a small vocabulary this script
writes (vocab.txt) from the basic tokens `transformers` itself makes of the
text. Every script's letters, accents and vowel signs, Unicode punctuation
of every class, symbols, control and zero-width characters, and special
tokens written in the text. Made once; the
tests read the JSON and never need Python; no model is downloaded.

    python3 -m venv /tmp/venv79 && /tmp/venv79/bin/pip install transformers
    /tmp/venv79/bin/python scripts/make_wordpiece_fixture.py

The ids are BertTokenizer's (the `tokenizers` library under transformers
5) and the script checks that the pure-Python BertTokenizerLegacy gives
the same; it stops where the two disagree, so the fixture is what both say.
"""
import json
import os
import sys

import transformers
from transformers import BertTokenizer
from transformers.models.bert.tokenization_bert_legacy import BasicTokenizer, BertTokenizerLegacy

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "wordpiece")

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

TEXTS = [
    # Latin with accents (precomposed), German, Scandinavian, Turkish dotted I
    "Élan, naïve café-goers — ÅNGSTRÖM façade; Straße «quoted» ¿Qué? ¡Sí! İstanbul ıstakoz Øresund Ærø",
    # Greek. Where the two disagree, left out: a capital sigma that ends a
    # word (lowercased, Python makes it final, `tokenizers` not), and, cased,
    # what NFC changes (only Python composes): the question mark U+037E
    "Καλημέρα κόσμε· ΟΔΥΣΣΕΙΑ; ἀρετή ΣΟΦΙΑ σοφός",
    # Cyrillic
    "Привет, мир! Ёлка «ёж» — Й й ЩУКА",
    # Arabic with harakat (Mn), Arabic comma, question mark, percent, digits
    "مرحبا بالعالم، كيف حالك؟ ٪ ٫ ٬ مُحَمَّد ١٢٣",
    # Hebrew with niqqud (Mn), sof pasuq, gershayim, maqaf
    "שָׁלוֹם עולם ׃ ״ציטוט״ דו־לשוני",
    # Devanagari: vowel signs Mc (ा ि ी) and Mn (े ं ्), danda, digits
    "नमस्ते दुनिया। हिन्दी भाषा॥ किताबें ०१२ मैं",
    # Thai: vowel signs Mn and Mc, its own punctuation and digits
    "สวัสดีชาวโลก ๏ ฯ ๚ ๑๒๓ ภาษาไทย",
    # CJK ideographs (spaced out), kana and Hangul (not), fullwidth punctuation
    "你好，世界！日本語のテキスト。한국어 텍스트 Hello世界123abc 「引用」",
    # emoji: a variation selector (Mn), a skin tone (Sk), zero-width joiners (Cf)
    "I \u2764\ufe0f Rust \U0001F980\U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467 ok\U0001F44Dok",
    # punctuation of every class: Pc Pd Ps Pe Pi Pf Po
    "a\u203fb c\u2040d e_f g\uff3fh | a\u2010b c\u2013d e\u2014f g\u2015h i\u2e3aj k\u301cl | "
    "(a) [b] {c} \u2045d\u2046 \u300ce\u300d \u300ef\u300f \u3010g\u3011 \u3008h\u3009 | "
    "\u00abi\u00bb \u2018j\u2019 \u201ck\u201d \u2039l\u203a | "
    "m\u2030n o\u2020p q\u2021r s\u2022t u\u2026v w\u203dx y\u2042z \u203b \u00a7 \u00b6 \u00b7 "
    "\u055a \u05c0 \u061b \u1362 \u104a \u17d5 \u1802 \ua4fe \ua60d \ua6f3 \U00010100 \u2e2e",
    # symbols that are not punctuation stay inside their word (outside ASCII)
    "5\u20ac \u00a3100 a+b x\u00b1y 3\u00d74 8\u00f72 \u00a9me \u00aeTM \u2122x 20\u00b0C \u2103 \u00acp \u00a6q $5 ^up `tick` ~t |p| <a> =b",
    # control and zero-width characters, whitespace of every kind
    "zero\u200bwidth soft\u00adhyphen joi\u200dner non\u200cjoiner bom\ufeffhere tab\there new\nline "
    "cr\rlf \x00nul \x07bell \x1bescape \x85nel vt\x0bff\x0cend \u2028ls\u2029ps \u00a0nbsp \u3000ideo "
    "\u2003em lrm\u200emark rlm\u200fmark \ufffdrepl priv\ue000ate \u2060wj \u180emvs",
    # compatibility forms (NFD keeps them), fullwidth letters, circled digits
    "\ufb01nance \uff21\uff22\uff23 \u2460\u2461 \u00bd \u2167 \u1e9b\u0323",
    # a word past 100 characters is [UNK]; the word after it is not
    "x" * 101 + " after " + "\u00e9" * 100 + " end",
    # special tokens written in the text are kept whole, only as written
    # (case and all); the text on each side of one is tokenized alone
    "hello[SEP]world [CLS]Stra\u00dfe[MASK] x[UNK]y [PAD] [sep] [ SEP ] [Mask] [[MASK]] "
    "na\u00efve[SEP]\u0301 \u4e16\u754c[SEP]\u754c xx[MASK]yy [CLS][SEP] \u00c9[UNK]\u00e9 end[",
]


def basic_tokens(lower):
    basic = BasicTokenizer(do_lower_case=lower)
    return [t for text in TEXTS for t in basic.tokenize(text)]


def make_vocab():
    """Specials; every character of the basic tokens as a first and a
    continuing piece (a few left out, to make [UNK]s); whole words for two
    in three words and a two-letter ending for the third, so that words are
    cut at several places."""
    left_out = {"\U0001F980", "\u203d", "\u2167"}
    seen, vocab = set(), []

    def add(t):
        if t not in seen:
            seen.add(t)
            vocab.append(t)

    for t in SPECIAL:
        add(t)
    words = basic_tokens(True) + basic_tokens(False)
    for w in words:
        for i, c in enumerate(w):
            if c not in left_out:
                add(c if i == 0 else "##" + c)
    for i, w in enumerate(words):
        if len(w) < 2 or len(w) > 100:
            continue
        if i % 3:
            add(w)
        elif len(w) >= 4:
            add("##" + w[-2:])
            add(w[:2])
    return vocab


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    vocab = make_vocab()
    vocab_path = os.path.join(OUT, "vocab.txt")
    with open(vocab_path, "w", encoding="utf-8", newline="\n") as f:
        f.write("".join(t + "\n" for t in vocab))
    ids = {t: i for i, t in enumerate(vocab)}
    cases = []
    for text in TEXTS:
        case = {"text": text}
        for name, lower in [("uncased", True), ("cased", False)]:
            fast = BertTokenizer(vocab=dict(ids), do_lower_case=lower)
            slow = BertTokenizerLegacy(vocab_path, do_lower_case=lower)
            a = fast(text, add_special_tokens=False)["input_ids"]
            b = slow(text, add_special_tokens=False)["input_ids"]
            if a != b:
                print(f"{name}: the two tokenizers disagree on {text!r}:\n{a}\n{b}", file=sys.stderr)
                return 1
            case[name] = a
        cases.append(case)
    fixture = {"transformers": transformers.__version__, "cases": cases}
    out = os.path.join(OUT, "ids.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=True, indent=0)
    unk = sum(c[k].count(ids["[UNK]"]) for c in cases for k in ("uncased", "cased"))
    print(f"{len(vocab)} tokens -> {vocab_path}; {len(cases)} texts ({unk} [UNK]s) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
