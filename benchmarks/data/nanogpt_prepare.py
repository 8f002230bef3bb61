"""The peer: the data-preparation recipe users copy from nanoGPT's data/openwebtext/prepare.py, written from its
description (not nanoGPT's text) and pointed at local .jsonl files.

    python benchmarks/data/nanogpt_prepare.py --out DIR --cache-dir DIR --num-proc N FILE.jsonl...

1. `datasets.load_dataset("json", data_files=FILES, num_proc=N)` converts the files to Arrow in the cache dir;
2. `.map(process, remove_columns=["text"], num_proc=N)`: per record, `enc.encode_ordinary(text)` plus the
   end-of-text token, and the record's length;
3. the lengths are summed, one uint16 `np.memmap` (DIR/train.bin) of that length is opened, and the tokenized
   dataset is copied into it in 1024 contiguous `dataset.shard(...)` batches, each `np.concatenate`d.

Differences from nanoGPT, all for the comparison: the GPT-2 encoding comes from local files
(`elastic_trainer.data.tokenizer.gpt2_encoding`; tiktoken.get_encoding("gpt2") downloads), there is no
train/val split (one train.bin), and datasets' progress bars are off. The last line of output is
`PEER {"tokens": ..., "documents": ..., "phases": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import datasets  # noqa: E402
import numpy as np  # noqa: E402

from elastic_trainer.data.tokenizer import gpt2_encoding  # noqa: E402

enc = gpt2_encoding()
T_IMPORTED = time.perf_counter()


def process(example):
    ids = enc.encode_ordinary(example["text"])  # special tokens in the text are plain characters
    ids.append(enc.eot_token)  # 50256, closing every document
    return {"ids": ids, "len": len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--num-proc", type=int, required=True)
    ap.add_argument("--total-batches", type=int, default=1024)
    args = ap.parse_args()
    datasets.disable_progress_bars()
    phases = {"import": T_IMPORTED - T_START}

    t = time.perf_counter()
    # load_dataset caps num_proc at the number of files (a warning, not an error)
    dataset = datasets.load_dataset(
        "json",
        data_files=args.files,
        split="train",
        cache_dir=args.cache_dir,
        num_proc=min(args.num_proc, len(args.files)) if len(args.files) > 1 else None,
    )
    phases["load_dataset"] = time.perf_counter() - t
    print(f"[peer] load_dataset: {len(dataset):,} documents in {phases['load_dataset']:.1f} s", flush=True)

    t = time.perf_counter()
    tokenized = dataset.map(process, remove_columns=["text"], desc="tokenizing", num_proc=args.num_proc)
    phases["map"] = time.perf_counter() - t
    print(f"[peer] map: {phases['map']:.1f} s", flush=True)

    t = time.perf_counter()
    arr_len = int(np.sum(tokenized["len"], dtype=np.uint64))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arr = np.memmap(out / "train.bin", dtype=np.uint16, mode="w+", shape=(arr_len,))
    total_batches = min(args.total_batches, len(tokenized))
    idx = 0
    for batch_idx in range(total_batches):
        batch = tokenized.shard(num_shards=total_batches, index=batch_idx, contiguous=True).with_format("numpy")
        arr_batch = np.concatenate(batch["ids"])
        arr[idx : idx + len(arr_batch)] = arr_batch
        idx += len(arr_batch)
    arr.flush()
    phases["write"] = time.perf_counter() - t
    print(f"[peer] write: {arr_len:,} tokens in {phases['write']:.1f} s", flush=True)
    print("PEER " + json.dumps({"tokens": arr_len, "documents": len(dataset), "phases": phases}), flush=True)


if __name__ == "__main__":
    main()
