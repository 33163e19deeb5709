#!/usr/bin/env python3
"""tests/fixtures/hf_tokenizer/ids.json: the ids `transformers`'
`AutoTokenizer` gives over a set of texts for each kind of GPT-2 export
distgpt writes (GPT-2's byte-level BPE, a character vocabulary, and a
BERT's WordPiece uncased and cased), with
the SHA-256 of every tokenizer file it loaded. Made once; the Rust test
re-exports, checks the files are the ones loaded here, and checks distgpt's
own ids against these. No model is downloaded; torch is not needed.

    cargo test --test hf_export write_tokenizer_exports -- --ignored
    python3 -m venv /tmp/venv79 && /tmp/venv79/bin/pip install transformers
    /tmp/venv79/bin/python scripts/make_tokenizer_fixture.py

The texts are in the Rust test (tests/hf_export.rs writes them beside the
exports as texts.json); this script checks that every GPT-2 text decodes back.
"""
import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
import transformers
from transformers import AutoTokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EXPORTS = os.path.join(ROOT, "target", "tmp", "tokenizer-exports")
OUT = os.path.join(ROOT, "tests", "fixtures", "hf_tokenizer", "ids.json")
SKIP = {"config.json", "model.safetensors", "texts.json"}


def fnv1a(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def main() -> int:
    with open(os.path.join(EXPORTS, "texts.json"), encoding="utf-8") as f:
        texts = json.load(f)
    out = {"transformers": transformers.__version__, "texts": texts, "exports": {}}
    for kind in sorted(os.listdir(EXPORTS)):
        folder = os.path.join(EXPORTS, kind)
        if not os.path.isdir(folder):
            continue
        files = {}
        for name in sorted(os.listdir(folder)):
            if name not in SKIP:
                with open(os.path.join(folder, name), "rb") as f:
                    files[name] = fnv1a(f.read())
        tok = AutoTokenizer.from_pretrained(folder)
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        # WordPiece is lossy (case, accents, spaces): only GPT-2's are checked
        for t, i in zip(texts if not kind.startswith("bert") else [], ids):
            back = tok.decode(i)
            if back != t:
                print(f"{kind}: {t!r} decodes as {back!r}", file=sys.stderr)
                return 1
        out["exports"][kind] = {"class": type(tok).__name__, "fnv1a": files, "ids": ids}
        print(f"{kind}: {type(tok).__name__}, {sum(map(len, ids))} ids over {len(texts)} texts")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
