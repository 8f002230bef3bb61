"""Hand-over rate between two hosts: a training state passed through host memory, beside a plain copy.

    .venv/bin/python benchmarks/rescale/handover_rate.py                       # gpt3-small and gpt3-medium
    .venv/bin/python benchmarks/rescale/handover_rate.py --models gpt3-small --rounds 1   # a quick look

Two "hosts" on this machine, each with its own shared-memory folder (ELASTIC_TRAINER_HOST names a rank's host;
the names resolve to loopback addresses, so the servers are reached over TCP as on two machines):

- old world: 2 ranks, rank 0 on host A (localhost), rank 1 on host B (127.0.0.2), dp 2 FSDP, fp32 weights and
  AdamW moments (filled as benchmarks/reshard does), `Checkpointer.write_memory`: each rank writes its DCP file
  into its own host's memory;
- new world: 2 ranks with the hosts swapped (rank 0 on B, rank 1 on A), the same layout, so every piece a rank
  reads is on the other host: `Checkpointer.in_memory` + `load_memory` fetch the pieces from that host's
  byte-range server (checkpoint/transfer.py; a rank's adjacent pieces of a file in one request) into the rank's
  host, then DCP reads them;
- plain copies of the very same files (the state's DCP files and metadata), in the same run: `shutil.copyfile`
  from one shared-memory folder to another (one thread, then one thread per file), and over a plain loopback TCP
  socket (the sender `socket.sendfile`, the receiver `recv_into` + `os.write` into a shared-memory file), one
  stream per file, the streams at once as the two ranks fetch at once.

Each round writes once; the new world's load (the package as it is) and the plain copies follow in an order
that reverses with the round; medians over rounds, and per-round ratios of fetch to copy rates (`--report`
summarizes the JSON's rounds again without measuring). The loaded state is checked against the saved one: per
weight and moment, row and column sums in float64 through DTensor.full_tensor (benchmarks/reshard's
fingerprints). Every measurement uses a fresh folder under /dev/shm,
removed afterwards. Writes benchmarks/rescale/handover_rate.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer, memory, storage  # noqa: E402
from elastic_trainer.config import TrainConfig, load_model_config  # noqa: E402
from elastic_trainer.elastic.handover import HOST_ENV  # noqa: E402
from elastic_trainer.parallel import build_mesh  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402
from elastic_trainer.train import Trainer, heap  # noqa: E402

HOST_A, HOST_B = "localhost", "127.0.0.2"
LAYOUT = Layout(2, 1, 1, 2, 1)  # dp 2 FSDP, global batch 4: both worlds
SEQ_LEN = 128
GB = 1e9
TIMEOUT = 1800
CHUNK = 8 << 20


def _reshard_module():
    spec = importlib.util.spec_from_file_location("reshard_bench", ROOT / "benchmarks" / "reshard" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_reshard = _reshard_module()
fill_optimizer_state, fingerprints = _reshard.fill_optimizer_state, _reshard.fingerprints


def quiet() -> None:
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - t0, result


def make_trainer(model: str, tokens) -> Trainer:
    cfg = TrainConfig(
        global_batch=LAYOUT.dp * LAYOUT.micro_batch * LAYOUT.num_microbatches,
        seq_len=SEQ_LEN,
        steps=10**6,
        seed=0,
        warmup_steps=1,
        grad_clip=1.0,
        weight_decay=0.1,
    )
    return Trainer(load_model_config(model), cfg, LAYOUT, build_mesh(LAYOUT, "cpu"), torch.device("cpu"), tokens=tokens)


def _place(rank: int, hosts: list[str], shm: str) -> None:
    os.environ[HOST_ENV] = hosts[rank]
    os.environ[memory.SHM_ENV] = shm


def old_world(rank, world, model, ckpt, shm, hosts, tokens):
    """Build, fill the moments, write the state into each rank's host memory."""
    quiet()
    _place(rank, hosts, shm)
    trainer = make_trainer(model, tokens)
    fill_optimizer_state(trainer)
    prints = fingerprints(trainer)
    ck = Checkpointer(CheckpointConfig(dir=ckpt), log=lambda *a, **k: None)
    ck.prepare_memory(trainer)  # as a world does while it waits to start (train/job.py): not timed
    ck.allocate_memory(wait=True)  # once the next world is started (train/job.py): not timed
    heap.settle()
    seconds, written = timed(lambda: ck.write_memory(trainer))
    if written.server is not None:
        written.server.stop()
    ck.close()
    return {
        "write_s": seconds,
        "bytes": written.bytes,
        "record": written.record,
        "folder": str(written.folder),
        "fingerprints": prints,
    }


def new_world(rank, world, model, ckpt, shm, hosts, tokens):
    """Find the state in memory and load it resharded, fetching the other host's pieces."""
    quiet()
    _place(rank, hosts, shm)
    trainer = make_trainer(model, tokens)
    trainer.warm_up()  # as the next world has before the state arrives (train/job.py): not timed
    heap.settle()
    ck = Checkpointer(CheckpointConfig(dir=ckpt), log=lambda *a, **k: None)

    def load():
        found = ck.in_memory()
        return ck.load_memory(trainer, found[0])

    seconds, (_, stats) = timed(load)
    ck.close()
    return {"load_s": seconds, "stats": dataclasses.asdict(stats), "fingerprints": fingerprints(trainer)}


# -- plain copies of the same files -----------------------------------------------------------------------


def state_files(shm: Path, record: dict) -> list[Path]:
    """The state's files (the record's: DCP files and metadata) in the hosts' folders under `shm`."""
    out = []
    for name, info in record["files"].items():
        found = list(shm.glob(f"elastic-trainer-*/*/{info['host']}/{record['name']}/{name}"))
        assert len(found) == 1, (name, found)
        out.append(found[0])
    return out


def copy_files(files: list[Path], target: Path, threads: int) -> float:
    """Seconds to copy `files` into `target` with shutil.copyfile (one file per thread, `threads` at once)."""
    target.mkdir(parents=True)
    t0 = time.perf_counter()
    if threads == 1:
        for f in files:
            shutil.copyfile(f, target / f"{f.parent.parent.name}-{f.name}")
    else:
        workers = [
            threading.Thread(target=shutil.copyfile, args=(f, target / f"{f.parent.parent.name}-{f.name}"))
            for f in files
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    seconds = time.perf_counter() - t0
    assert sum(p.stat().st_size for p in target.iterdir()) == sum(f.stat().st_size for f in files)
    shutil.rmtree(target)
    return seconds


def tcp_copy(files: list[Path], target: Path, host: str = HOST_B) -> float:
    """Seconds to send `files` over loopback TCP (socket.sendfile) into files under `target`, one connection
    per file, all at once."""
    target.mkdir(parents=True)
    listener = socket.create_server(("0.0.0.0", 0))
    listener.listen(len(files))
    port = listener.getsockname()[1]
    errors = []

    def serve():
        for _ in files:
            conn, _ = listener.accept()
            threading.Thread(target=send, args=(conn,), daemon=True).start()

    def send(conn):
        try:
            with conn:
                index = int.from_bytes(conn.recv(4), "big")
                with open(files[index], "rb") as f:
                    conn.sendfile(f)
        except OSError as e:
            errors.append(e)

    def receive(index: int):
        try:
            size = files[index].stat().st_size
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            with socket.create_connection((host, port)) as sock:
                sock.sendall(index.to_bytes(4, "big"))
                fd = os.open(target / f"{index}-{files[index].name}", os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    done = 0
                    while done < size:
                        n = sock.recv_into(view, min(CHUNK, size - done))
                        if not n:
                            raise OSError(f"closed after {done} of {size} bytes")
                        os.write(fd, view[:n])
                        done += n
                finally:
                    os.close(fd)
        except OSError as e:
            errors.append(e)

    threading.Thread(target=serve, daemon=True).start()
    t0 = time.perf_counter()
    workers = [threading.Thread(target=receive, args=(i,)) for i in range(len(files))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    listener.close()
    if errors:
        raise errors[0]
    assert sum(p.stat().st_size for p in target.iterdir()) == sum(f.stat().st_size for f in files)
    shutil.rmtree(target)
    return seconds


def plain_copies(files: list[Path], scratch: Path) -> dict:
    nbytes = sum(f.stat().st_size for f in files)
    out = {}
    for name, fn in (
        ("copyfile_1thread", lambda: copy_files(files, scratch / "copy1", 1)),
        ("copyfile_threads", lambda: copy_files(files, scratch / "copyN", len(files))),
        ("tcp_sendfile", lambda: tcp_copy(files, scratch / "tcp")),
    ):
        seconds = fn()
        out[name] = {"s": seconds, "gbs": nbytes / seconds / GB}
    return out


# -- one round ------------------------------------------------------------------------------------------------


def max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for key in a:
        for x, y in zip(a[key], b[key]):
            x, y = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
            worst = max(worst, ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item())
    return worst


def pieces(files: list[Path]) -> dict:
    """The state's stored pieces (DCP storage items; the load fetches a rank's adjacent pieces of a file in one
    request, memory._merged)."""
    meta = next(f for f in files if f.name == ".metadata")
    sizes = [i.length for i in storage.parse_dcp_metadata(meta.read_bytes(), str(meta)).storage_data.values()]
    return {
        "count": len(sizes),
        "under_64kb": sum(n < 64 << 10 for n in sizes),
        "under_64kb_bytes": sum(n for n in sizes if n < 64 << 10),
        "largest": max(sizes),
    }


def load_once(model, ckpt, shm, tokens) -> dict:
    new = run_ranks(new_world, 2, model, str(ckpt), str(shm), [HOST_B, HOST_A], tokens, timeout=TIMEOUT)
    stats = new[0]["stats"]
    return {
        "load_s": new[0]["load_s"],
        "bytes_total": stats["bytes_total"],
        "bytes_read": stats["bytes_read"],
        "bytes_fetched": stats["bytes_fetched"],
        "fetch_s": stats["fetch_s"],
        "fetch_s_max_rank": max(n["stats"]["fetch_s"] for n in new),
        "read_s": stats["read_s"],
        "load_total_s": stats["total_s"],
        "fetch_gbs": stats["bytes_fetched"] / stats["fetch_s"] / GB,
        "fingerprints": new[0]["fingerprints"],
    }


def one_round(model: str, r: int, tokens, base: Path) -> dict:
    """Write once; then, in an order that alternates with the round, the hand-over load and the plain copies
    (the load leaves the written state in memory: only its own folder of fetched pieces is removed)."""
    tag = f"{model}-{r}"
    shm = Path("/dev/shm") / f"handover-rate-{os.getpid()}-{tag}"
    scratch = Path("/dev/shm") / f"handover-rate-{os.getpid()}-{tag}-copies"
    ckpt = base / tag
    for p in (shm, scratch, ckpt):
        shutil.rmtree(p, ignore_errors=True)
    try:
        print(f"[{model} round {r + 1}] old world: write on {HOST_A}, {HOST_B} ...", flush=True)
        old = run_ranks(old_world, 2, model, str(ckpt), str(shm), [HOST_A, HOST_B], tokens, timeout=TIMEOUT)
        files = state_files(shm, old[0]["record"])
        out = {
            "state_bytes": sum(f.stat().st_size for f in files),
            "write_s": old[0]["write_s"],
            "pieces": pieces(files),
        }
        order = ["load", "copies"]
        if r % 2:
            order.reverse()
        for step in order:
            what = "plain copies" if step == "copies" else f"new world: load on {HOST_B}, {HOST_A}"
            print(f"[{model} round {r + 1}] {what} ...", flush=True)
            if step == "copies":
                out["copies"] = plain_copies(files, scratch)
                continue
            load = load_once(model, ckpt, shm, tokens)
            load["reloaded_max_rel_diff"] = max_rel_diff(old[0]["fingerprints"], load.pop("fingerprints"))
            load["handover_s"] = out["write_s"] + load["load_s"]
            out["load"] = load
        out["order"] = order
        out["fingerprints_compared"] = len(old[0]["fingerprints"])
        return out
    finally:
        for p in (shm, scratch, ckpt):
            shutil.rmtree(p, ignore_errors=True)


def summarize(model: str, rounds: list[dict]) -> dict:
    out = {
        "model": model,
        "rounds": len(rounds),
        "layout": LAYOUT.describe(),
        "hosts_old": [HOST_A, HOST_B],
        "hosts_new": [HOST_B, HOST_A],
        "state_bytes": rounds[0]["state_bytes"],
        "pieces": rounds[0]["pieces"],
        "write_s": statistics.median(x["write_s"] for x in rounds),
    }
    runs = [x["load"] for x in rounds]
    out["load"] = {key: statistics.median(x[key] for x in runs) for key in runs[0] if key != "reloaded_max_rel_diff"}
    out["load"]["reloaded_max_rel_diff"] = max(x["reloaded_max_rel_diff"] for x in runs)
    out["copies"] = {
        name: {
            "s": statistics.median(x["copies"][name]["s"] for x in rounds),
            "gbs": statistics.median(x["copies"][name]["gbs"] for x in rounds),
        }
        for name in rounds[0]["copies"]
    }
    # ratios within each round (both sides of a ratio measured minutes apart), then their median
    out["fetch_vs_copy"] = {
        name: statistics.median(x["load"]["fetch_gbs"] / x["copies"][name]["gbs"] for x in rounds)
        for name in out["copies"]
    }
    out["per_round"] = rounds
    return out


def report(results: dict) -> None:
    print(f"\nhand-over between two loopback hosts ({results['cpus']} CPUs), medians of the rounds")
    print(
        f"{'state':<12} {'rounds':>6} {'GB':>5} {'write s':>8} {'load s':>7} {'hand-over s':>11} {'fetched GB':>10} "
        f"{'fetch s':>7} {'fetch GB/s':>10} {'max rel diff':>12}"
    )
    for model, m in results["models"].items():
        x = m["load"]
        print(
            f"{model:<12} {m['rounds']:6d} {m['state_bytes'] / GB:5.2f} {m['write_s']:8.2f} {x['load_s']:7.2f} "
            f"{x['handover_s']:11.2f} {x['bytes_fetched'] / GB:10.2f} {x['fetch_s']:7.2f} {x['fetch_gbs']:10.2f} "
            f"{x['reloaded_max_rel_diff']:12.1e}"
        )
    print(
        f"\n{'state':<12} {'pieces':>6} {'< 64 KB':>7} | plain copy of the same files, GB/s: "
        f"{'copyfile':>8} {'copyfile x2':>11} {'TCP sendfile x2':>15}"
    )
    for model, m in results["models"].items():
        c, pc = m["copies"], m["pieces"]
        print(
            f"{model:<12} {pc['count']:6d} {pc['under_64kb']:7d} | {'':35}{c['copyfile_1thread']['gbs']:8.2f} "
            f"{c['copyfile_threads']['gbs']:11.2f} {c['tcp_sendfile']['gbs']:15.2f}"
        )
    print("\nfetch GB/s / copy GB/s (per round, then the median):")
    for model, m in results["models"].items():
        print(f"{model:<12} " + "   ".join(f"{k} {v:.3f}" for k, v in m["fetch_vs_copy"].items()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt3-small,gpt3-medium")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default="/tmp/elastic-trainer-handover-rate", help="checkpoint folders (ids only)")
    p.add_argument("--out", default=str(Path(__file__).with_name("handover_rate.json")))
    p.add_argument("--report", action="store_true", help="summarize and print --out's rounds again, measure nothing")
    args = p.parse_args(argv)
    quiet()
    if args.report:
        results = json.loads(Path(args.out).read_text())
        results["models"] = {m: summarize(m, x["per_round"]) for m, x in results["models"].items()}
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        report(results)
        return
    results = {"torch": torch.__version__, "cpus": os.cpu_count(), "models": {}}
    base = Path(args.dir)
    for model in args.models.split(","):
        tokens = (
            np.random.default_rng(0)
            .integers(0, load_model_config(model).vocab_size, 256 * (SEQ_LEN + 1) + 1)
            .astype(np.int64)
        )
        rounds = [one_round(model, r, tokens, base) for r in range(args.rounds)]
        results["models"][model] = summarize(model, rounds)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    shutil.rmtree(base, ignore_errors=True)
    report(results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
