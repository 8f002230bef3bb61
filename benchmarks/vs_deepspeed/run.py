"""elastic_trainer against DeepSpeed in the same run on the same machine: reconfiguration and step time.

    python benchmarks/vs_deepspeed/run.py                              # gpt3-small: ~10 min on 2 cores
    python benchmarks/vs_deepspeed/run.py --reconfig-models gpt3-small,gpt3-medium
    python benchmarks/vs_deepspeed/run.py --only step --step-model gpt-tiny --steps 2   # a quick look

Needs DeepSpeed (`pip install --no-build-isolation deepspeed==0.19.8`, which scripts/test.sh also does).
Ranks are gloo processes forked from this one; each system runs its own documented path:

- **reconfiguration**: the same GPT state (fp32 weights from the same initialization, AdamW moments filled
  with values derived from the weights, step 7) is saved by 4 data-parallel ranks and loaded by 2.
  DeepSpeed: `engine.save_checkpoint` (ZeRO-1) -> `ds_to_universal` (its converter, a separate process as
  its documentation runs it; the interpreter's start and DeepSpeed's import are measured apart and left out
  of its time) -> a new engine on 2 ranks with `"checkpoint": {"load_universal": true}` and
  `engine.load_checkpoint`. Ours: `Checkpointer.save` (fsync, checksums, atomic commit) -> `Checkpointer.load`
  on 2 ranks (checksum verification and DCP's resharding load). Ours through memory (the planned
  reconfiguration's path): `Checkpointer.write_memory` on the 4 ranks (DCP's plan, made beforehand with
  `prepare_memory` as a warm world does while it waits, each piece as its bytes, into shared memory, a fresh
  folder under /dev/shm, into files allocated with `allocate_memory` as a stopping world does once the next
  world is started; the allocation is untimed and reported) -> `Checkpointer.in_memory` + `load_memory` on 2 ranks
  (DCP's resharding plan, read from there), by ranks that took their warm-up step first, as the next world of
  a planned reconfiguration does while the old one still trains;
  the durable checkpoint of that state (`Checkpointer.persist`) is written by the stopping ranks after the
  write, off the critical path (in a reconfiguration it runs while the next world loads and trains), and
  timed apart. Each side checks its reloaded weights and both moments against what it saved (per tensor,
  row and column sums in float64 through its own full-tensor accessors), and the two sides' initial weights
  against each other.
- **step time**: the same model, global batch, sequence length and micro-batch: data parallel on 4 ranks
  (ours FSDP2 against ZeRO-1 and ZeRO-3) and 2 pipeline stages x 2 data-parallel ranks (ours against
  `PipelineModule` with ZeRO-1); AdamW, clipping at 1.0, fp32.

Systems alternate within the run (ours, DeepSpeed, ours, DeepSpeed...) so the machine's drift hits both.
Prints each phase and the ratio deepspeed_s / ours_s (above 1: ours is faster); writes results.json with per
case {"ours_s", "deepspeed_s", "ratio"} and the phases (reconfiguration also "ours_memory_s" and
"ratio_memory" = deepspeed_s / ours_memory_s).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elastic_trainer.checkpoint import CheckpointConfig, Checkpointer, memory, storage  # noqa: E402
from elastic_trainer.config import ModelConfig, TrainConfig, load_model_config  # noqa: E402
from elastic_trainer.parallel import build_mesh  # noqa: E402
from elastic_trainer.parallel.local_ranks import run_ranks  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402
from elastic_trainer.train import Trainer, heap  # noqa: E402


def _reshard_module():
    """benchmarks/reshard/run.py: the same moments filling and fingerprints as the reshard benchmark."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reshard_bench", ROOT / "benchmarks" / "reshard" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_reshard = _reshard_module()
fill_optimizer_state, fingerprints = _reshard.fill_optimizer_state, _reshard.fingerprints

INSTALL = "pip install --no-build-isolation deepspeed==0.19.8"
TAG = "global_step7"
SEED = 0
TIMEOUT = 3600


def quiet() -> None:
    warnings.simplefilter("ignore")
    for name in ("torch.distributed.tensor._redistribute", "DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - t0, result


def train_cfg(global_batch: int, seq_len: int) -> TrainConfig:
    return TrainConfig(
        global_batch=global_batch,
        seq_len=seq_len,
        steps=10**6,
        seed=SEED,
        warmup_steps=1,
        grad_clip=1.0,
        weight_decay=0.1,
    )


def tokens_for(model: ModelConfig, seq_len: int, samples: int = 256) -> np.ndarray:
    return np.random.default_rng(0).integers(0, model.vocab_size, samples * (seq_len + 1) + 1).astype(np.int64)


# -- DeepSpeed's side -------------------------------------------------------------------------------------------


def ds_engine(
    model_name: str,
    world_dp: int,
    stage: int,
    *,
    micro: int = 1,
    gas: int = 1,
    pipeline: int = 0,
    extra: dict | None = None,
):
    """A DeepSpeed engine over our GPT (our initialization for SEED), torch AdamW with our decay groups."""
    import deepspeed

    from elastic_trainer.interop.deepspeed import pipeline_gpt
    from elastic_trainer.model.gpt import GPT
    from elastic_trainer.model.init import materialize

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_model_config(model_name)
    with torch.device("meta"):
        gpt = GPT(cfg)
    gpt = materialize(gpt, "cpu", SEED)
    module = gpt
    if pipeline:
        module = pipeline_gpt.pipeline_module(cfg, pipeline, partition_method="uniform")
        pipeline_gpt.copy_weights_into_pipeline(gpt, module)
        del gpt
    params = [p for p in module.parameters()]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=6e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    config = {
        "train_batch_size": world_dp * micro * gas,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        **(extra or {}),
    }
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine


@torch.no_grad()
def ds_fill(engine) -> None:
    """The same derived moments as benchmarks/reshard's fill_optimizer_state, on ZeRO-1's flat partitions."""
    zero = engine.optimizer
    for flat in zero.single_partition_of_fp32_groups:
        state = zero.optimizer.state[flat]  # torch AdamW's own keys (DeepSpeed creates them at the first step)
        state["step"] = torch.tensor(7.0)
        state["exp_avg"] = flat * 0.5
        state["exp_avg_sq"] = flat * flat
    zero._lazy_init_hp_params_optimizer_state()  # what DeepSpeed does after its first step: link the state


@torch.no_grad()
def ds_fingerprints(engine) -> dict[str, list]:
    """Row and column sums (float64) of each full fp32 weight and moment, through DeepSpeed's accessors."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        for key, get in (
            ("param", lambda: safe_get_full_fp32_param(p)),
            ("exp_avg", lambda: safe_get_full_optimizer_state(p, "exp_avg")),
            ("exp_avg_sq", lambda: safe_get_full_optimizer_state(p, "exp_avg_sq")),
        ):
            t = get().double()
            sums = [t] if t.ndim == 1 else [t.sum(dim=1), t.sum(dim=0)]
            out[f"{key}/{name}"] = [s.tolist() for s in sums]
    return out


def ds_save_job(rank, world, model, folder):
    quiet()
    engine = ds_engine(model, world, 1)
    ds_fill(engine)
    prints = ds_fingerprints(engine)
    seconds, _ = timed(lambda: engine.save_checkpoint(str(folder), tag=TAG))
    return {"save_s": seconds, "fingerprints": prints}


def ds_load_job(rank, world, model, folder):
    quiet()
    engine = ds_engine(model, world, 1, extra={"checkpoint": {"load_universal": True}})
    seconds, (path, _) = timed(
        lambda: engine.load_checkpoint(str(folder), tag=f"{TAG}_universal", load_module_strict=True)
    )
    assert path is not None, "DeepSpeed loaded nothing"
    engine.optimizer._lazy_init_hp_params_optimizer_state()  # link the loaded state to the parameters (no-op if done)
    return {"load_s": seconds, "fingerprints": ds_fingerprints(engine)}


def ds_convert(folder: Path) -> dict:
    """ds_to_universal as its documentation runs it; the interpreter start + DeepSpeed import measured apart."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import deepspeed.checkpoint.ds_to_universal"], check=True, capture_output=True
    )
    startup = time.perf_counter() - t0
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(folder / TAG),
        "--output_folder",
        str(folder / f"{TAG}_universal"),
        "--inject_missing_state",
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    total = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"ds_to_universal failed: {done.stderr[-3000:]}")
    return {"convert_s": max(0.0, total - startup), "convert_with_startup_s": total, "startup_s": startup}


# -- our side ---------------------------------------------------------------------------------------------------


def our_trainer(model: str, layout: Layout, seq_len: int, tokens) -> Trainer:
    return Trainer(
        load_model_config(model),
        train_cfg(layout.dp * layout.micro_batch * layout.num_microbatches, seq_len),
        layout,
        build_mesh(layout, "cpu"),
        torch.device("cpu"),
        tokens=tokens,
    )


def ours_save_job(rank, world, model, folder, tokens):
    quiet()
    trainer = our_trainer(model, Layout(world, 1, 1, 4 // world, 1), 128, tokens)
    fill_optimizer_state(trainer)
    prints = fingerprints(trainer)
    heap.settle()  # as a world does once its state is loaded (train/job.py), before it trains and saves
    ck = Checkpointer(CheckpointConfig(dir=str(folder)), log=lambda *a, **k: None)
    seconds, stats = timed(lambda: ck.save(trainer, blocking=True))
    ck.close()
    return {"save_s": seconds, "fingerprints": prints, "path": stats.path}


def ours_load_job(rank, world, model, folder, tokens):
    quiet()
    trainer = our_trainer(model, Layout(world, 1, 1, 4 // world, 1), 128, tokens)  # the saver's global batch
    ck = Checkpointer(CheckpointConfig(dir=str(folder)), log=lambda *a, **k: None)
    target = storage.complete_checkpoints(folder)[0]
    seconds, _ = timed(lambda: ck.load(trainer, str(target)))  # verification included, as by default
    ck.close()
    return {"load_s": seconds, "fingerprints": fingerprints(trainer)}


def ours_memory_write_job(rank, world, model, folder, shm, tokens):
    """The stopping world of a planned reconfiguration: the state into this host's memory (timed), then its
    durable checkpoint from that copy (persist, timed apart: off the critical path)."""
    quiet()
    os.environ[memory.SHM_ENV] = shm
    trainer = our_trainer(model, Layout(world, 1, 1, 4 // world, 1), 128, tokens)
    fill_optimizer_state(trainer)
    prints = fingerprints(trainer)
    ck = Checkpointer(CheckpointConfig(dir=str(folder)), log=lambda *a, **k: None)
    ck.prepare_memory(trainer)  # what a world does while it waits to start (train/job.py): not timed
    ck.allocate_memory(wait=True)  # once the next world is started (train/job.py): not timed
    heap.settle()
    seconds, written = timed(lambda: ck.write_memory(trainer))
    persist_s, durable = timed(lambda: ck.persist(written))
    if written.server is not None:
        written.server.stop()
    ck.close()
    return {
        "write_s": seconds,
        "persist_s": persist_s,
        "durable": durable.path,
        "bytes": written.bytes,
        "allocate_s": (written.ahead or {}).get("allocate_s") or 0.0,
        "fingerprints": prints,
    }


def ours_memory_load_job(rank, world, model, folder, shm, tokens):
    """The next world: find the state in memory and read it resharded."""
    quiet()
    os.environ[memory.SHM_ENV] = shm
    trainer = our_trainer(model, Layout(world, 1, 1, 4 // world, 1), 128, tokens)  # the saver's global batch
    trainer.warm_up()  # what the next world has done before the state arrives (train/job.py)
    heap.settle()
    ck = Checkpointer(CheckpointConfig(dir=str(folder)), log=lambda *a, **k: None)

    def load():
        found = ck.in_memory()
        assert found, "no state in memory"
        return ck.load_memory(trainer, found[0])

    seconds, (_, stats) = timed(load)
    ck.close()
    return {
        "load_s": seconds,
        "bytes_read": stats.bytes_read,
        "bytes_fetched": stats.bytes_fetched,
        "fingerprints": fingerprints(trainer),
    }


# -- comparisons --------------------------------------------------------------------------------------------------


def merged(results: list[dict]) -> dict:
    out = {}
    for r in results:
        out.update(r["fingerprints"])
    return out


def max_rel_diff(a: dict, b: dict, keys=None) -> float:
    keys = keys or a.keys()
    worst = 0.0
    for key in keys:
        for x, y in zip(a[key], b[key]):
            x, y = torch.tensor(x), torch.tensor(y)
            worst = max(worst, ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item())
    return worst


def ours_reconfig(model: str, folder: Path, save_world: int, load_world: int, tokens) -> dict:
    """Our path, back to back as a reconfiguration runs it: save on save_world ranks, load on load_world."""
    print(f"[reconfig {model}] ours: save on {save_world} ranks, load on {load_world} ...", flush=True)
    saved = run_ranks(ours_save_job, save_world, model, folder, tokens, timeout=TIMEOUT)
    loaded = run_ranks(ours_load_job, load_world, model, folder, tokens, timeout=TIMEOUT)
    nbytes = sum(f.stat().st_size for f in Path(saved[0]["path"]).iterdir())
    return {
        "save_s": saved[0]["save_s"],
        "load_s": loaded[0]["load_s"],
        "bytes": nbytes,
        "saved": merged(saved),
        "loaded": merged(loaded),
    }


def ours_memory_reconfig(model: str, folder: Path, save_world: int, load_world: int, tokens) -> dict:
    """Our planned path: write_memory on save_world ranks (then persist, apart), load_memory on load_world."""
    print(f"[reconfig {model}] ours through memory: write on {save_world} ranks, load on {load_world} ...", flush=True)
    shm = Path("/dev/shm") / f"elastic-trainer-vs-deepspeed-{os.getpid()}"
    shutil.rmtree(shm, ignore_errors=True)
    try:
        saved = run_ranks(ours_memory_write_job, save_world, model, folder, str(shm), tokens, timeout=TIMEOUT)
        loaded = run_ranks(ours_memory_load_job, load_world, model, folder, str(shm), tokens, timeout=TIMEOUT)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    durable = sum(f.stat().st_size for f in Path(saved[0]["durable"]).iterdir())
    return {
        "write_s": saved[0]["write_s"],
        "load_s": loaded[0]["load_s"],
        "persist_s": saved[0]["persist_s"],
        "allocate_s": max(x["allocate_s"] for x in saved),
        "bytes": saved[0]["bytes"],
        "durable_bytes": durable,
        "bytes_fetched": loaded[0]["bytes_fetched"],
        "saved": merged(saved),
        "loaded": merged(loaded),
    }


def ds_reconfig(model: str, folder: Path, save_world: int, load_world: int) -> dict:
    """DeepSpeed's documented path, back to back: save_checkpoint, ds_to_universal, load_universal."""
    print(
        f"[reconfig {model}] DeepSpeed: save on {save_world} ranks, ds_to_universal, load_universal on "
        f"{load_world} ...",
        flush=True,
    )
    saved = run_ranks(ds_save_job, save_world, model, folder, timeout=TIMEOUT)
    nbytes = sum(f.stat().st_size for f in (folder / TAG).iterdir())
    conv = ds_convert(folder)
    loaded = run_ranks(ds_load_job, load_world, model, folder, timeout=TIMEOUT)
    return {
        "save_s": saved[0]["save_s"],
        **conv,
        "load_s": loaded[0]["load_s"],
        "bytes": nbytes,
        "saved": merged(saved),
        "loaded": merged(loaded),
    }


def reconfiguration(model: str, scratch: Path, save_world: int, load_world: int, tokens, rounds: int) -> dict:
    """`rounds` alternations (ours durable, ours through memory, DeepSpeed in even rounds, the reverse in odd
    ones); each side's save is followed at once by its own load, so neither side's files are evicted by the
    other's work in between. Per side the median of the totals and of each phase is reported (with two rounds:
    their means)."""
    runs = {"ours": [], "ours_memory": [], "deepspeed": []}
    sides = {
        "ours": lambda: ours_reconfig(model, scratch, save_world, load_world, tokens),
        "ours_memory": lambda: ours_memory_reconfig(model, scratch, save_world, load_world, tokens),
        "deepspeed": lambda: ds_reconfig(model, scratch, save_world, load_world),
    }
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            runs[side].append(sides[side]())
    shutil.rmtree(scratch, ignore_errors=True)
    o_runs, m_runs, d_runs = runs["ours"], runs["ours_memory"], runs["deepspeed"]
    o_tot = [x["save_s"] + x["load_s"] for x in o_runs]
    m_tot = [x["write_s"] + x["load_s"] for x in m_runs]
    d_tot = [x["save_s"] + x["convert_s"] + x["load_s"] for x in d_runs]
    o, d = o_runs[0], d_runs[0]
    # the two sides start from the same weights (our names; DeepSpeed sees the same module)
    same_init = max_rel_diff(o["saved"], d["saved"], [k for k in o["saved"] if k.startswith("param/")])
    phases = ("save_s", "load_s")
    ds_phases = ("save_s", "convert_s", "convert_with_startup_s", "startup_s", "load_s")
    m_phases = ("write_s", "load_s", "persist_s", "allocate_s")
    ours_s, memory_s, ds_s = statistics.median(o_tot), statistics.median(m_tot), statistics.median(d_tot)
    return {
        "model": model,
        "save_ranks": save_world,
        "load_ranks": load_world,
        "rounds": rounds,
        "ours_bytes": o["bytes"],
        "deepspeed_bytes": d["bytes"],
        "ours": {
            **{k: statistics.median(x[k] for x in o_runs) for k in phases},
            "totals_s": o_tot,
            "reloaded_max_rel_diff": max(max_rel_diff(x["saved"], x["loaded"]) for x in o_runs),
        },
        "ours_memory": {
            **{k: statistics.median(x[k] for x in m_runs) for k in m_phases},
            "totals_s": m_tot,
            "bytes": m_runs[0]["bytes"],
            "durable_bytes": m_runs[0]["durable_bytes"],
            "bytes_fetched": max(x["bytes_fetched"] for x in m_runs),
            "reloaded_max_rel_diff": max(max_rel_diff(x["saved"], x["loaded"]) for x in m_runs),
        },
        "deepspeed": {
            **{k: statistics.median(x[k] for x in d_runs) for k in ds_phases},
            "totals_s": d_tot,
            "reloaded_max_rel_diff": max(max_rel_diff(x["saved"], x["loaded"]) for x in d_runs),
        },
        "initial_weights_max_rel_diff": same_init,
        "ours_s": ours_s,
        "deepspeed_s": ds_s,
        "ratio": ds_s / ours_s,
        "ours_memory_s": memory_s,
        "ratio_memory": ds_s / memory_s,
    }


# -- step time --------------------------------------------------------------------------------------------------


def ours_steps_job(rank, world, model, layout, seq_len, steps, warmup, tokens):
    quiet()
    trainer = our_trainer(model, layout, seq_len, tokens)
    times = []
    for i in range(warmup + steps):
        seconds, _ = timed(trainer.train_step)
        if i >= warmup:
            times.append(seconds)
    return times


def ds_steps_job(rank, world, model, kind, seq_len, global_batch, micro, steps, warmup, tokens):
    quiet()
    from elastic_trainer.interop.deepspeed.pipeline_gpt import lm_loss

    pipeline = 2 if kind == "pipeline" else 0
    dp = world // (pipeline or 1)
    gas = global_batch // (dp * micro)
    engine = ds_engine(model, dp, 3 if kind == "zero3" else 1, micro=micro, gas=gas, pipeline=pipeline)
    samples = torch.from_numpy(tokens[: (len(tokens) - 1) // (seq_len + 1) * (seq_len + 1)]).view(-1, seq_len + 1)
    dp_rank = engine.grid.data_parallel_id if pipeline else rank
    times = []
    for i in range(warmup + steps):
        start = (i * global_batch + dp_rank * micro * gas) % (len(samples) - micro * gas)
        batch = samples[start : start + micro * gas]
        micro_batches = [(b[:, :-1], b[:, 1:]) for b in batch.split(micro)]

        def step():
            if pipeline:
                return engine.train_batch(iter(micro_batches))
            for x, y in micro_batches:
                engine.backward(lm_loss(engine(x), y))
                engine.step()

        seconds, _ = timed(step)
        if i >= warmup:
            times.append(seconds)
    return times


STEP_CASES = {  # name: (our layout degrees (dp, tp, pp), our dp mode, DeepSpeed's kind)
    "dp4: FSDP2 vs ZeRO-1": ((4, 1, 1), "fsdp", "zero1"),
    "dp4: FSDP2 vs ZeRO-3": ((4, 1, 1), "fsdp", "zero3"),
    "dp4: replicated (ddp) vs ZeRO-1": ((4, 1, 1), "ddp", "zero1"),
    "dp4: zero1 vs ZeRO-1": ((4, 1, 1), "zero1", "zero1"),
    "pp2 x dp2: ours vs PipelineModule (ZeRO-1)": ((2, 1, 2), "fsdp", "pipeline"),
    "pp2 x dp2: ours zero1 vs PipelineModule (ZeRO-1)": ((2, 1, 2), "zero1", "pipeline"),
}


def step_time(
    model: str,
    seq_len: int,
    global_batch: int,
    micro: int,
    steps: int,
    warmup: int,
    rounds: int,
    tokens,
    cases: list[str] | None = None,
) -> dict:
    out = {}
    for name, ((dp, tp, pp), mode, kind) in STEP_CASES.items():
        if cases and name not in cases:
            continue
        layout = Layout(dp, tp, pp, micro, global_batch // (dp * micro), dp_mode=mode)
        ours, theirs = [], []
        for r in range(rounds):  # alternate: ours, DeepSpeed, ours, DeepSpeed
            print(f"[step {name}] round {r + 1}/{rounds}: ours ...", flush=True)
            ours += run_ranks(ours_steps_job, 4, model, layout, seq_len, steps, warmup, tokens, timeout=TIMEOUT)[0]
            print(f"[step {name}] round {r + 1}/{rounds}: DeepSpeed ...", flush=True)
            theirs += run_ranks(
                ds_steps_job, 4, model, kind, seq_len, global_batch, micro, steps, warmup, tokens, timeout=TIMEOUT
            )[0]
        o, d = statistics.median(ours), statistics.median(theirs)
        out[name] = {
            "layout": layout.describe(),
            "deepspeed": kind,
            "ours_steps_s": ours,
            "deepspeed_steps_s": theirs,
            "ours_s": o,
            "deepspeed_s": d,
            "ratio": d / o,
        }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("reconfig", "step"), help="run one part")
    p.add_argument("--reconfig-models", default="gpt3-small")
    p.add_argument("--reconfig-rounds", type=int, default=2, help="alternations of the two systems per model")
    p.add_argument("--step-model", default="gpt3-small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two systems per step case")
    p.add_argument(
        "--step-cases",
        help="comma-separated names of STEP_CASES to run (default: all), e.g. 'dp4: replicated (ddp) vs ZeRO-1'",
    )
    p.add_argument("--dir", default="/tmp/elastic-trainer-vs-deepspeed", help="scratch folder")
    p.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    args = p.parse_args(argv)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        sys.exit(f"DeepSpeed is not installed: {INSTALL}")
    quiet()
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    results.update({"torch": torch.__version__, "deepspeed": deepspeed.__version__, "cpus": os.cpu_count()})
    if args.only in (None, "reconfig"):
        results.setdefault("reconfiguration", {})
        for model in args.reconfig_models.split(","):
            r = reconfiguration(
                model,
                Path(args.dir) / model,
                4,
                2,
                tokens_for(load_model_config(model), args.seq_len),
                args.reconfig_rounds,
            )
            results["reconfiguration"][model] = r
            out_path.write_text(json.dumps(results, indent=1) + "\n")
    if args.only in (None, "step"):
        model = load_model_config(args.step_model)
        previous = results.get("step_time", {})
        settings = {
            "model": args.step_model,
            "seq_len": args.seq_len,
            "global_batch": args.global_batch,
            "micro_batch": args.micro_batch,
        }
        kept = previous.get("cases", {}) if all(previous.get(k) == v for k, v in settings.items()) else {}
        wanted = args.step_cases.split(",") if args.step_cases else None
        cases = step_time(
            args.step_model,
            args.seq_len,
            args.global_batch,
            args.micro_batch,
            args.steps,
            args.warmup,
            args.rounds,
            tokens_for(model, args.seq_len),
            wanted,
        )
        results["step_time"] = {**settings, "cases": {**kept, **cases}}
        out_path.write_text(json.dumps(results, indent=1) + "\n")
    report(results)
    print(f"\nwrote {out_path}")


def _runs(side: dict) -> str:
    return "(" + ", ".join(f"{t:.1f}" for t in side.get("totals_s", ())) + ")"


def report(results: dict) -> None:
    for model, r in results.get("reconfiguration", {}).items():
        o, d = r["ours"], r["deepspeed"]
        print(
            f"\nreconfiguration {model}: {r['save_ranks']} ranks -> {r['load_ranks']} ranks, "
            f"ours {r['ours_bytes'] / 1e9:.2f} GB, DeepSpeed {r['deepspeed_bytes'] / 1e9:.2f} GB"
        )
        print(
            f"  ours       save {o['save_s']:6.1f} s                          load {o['load_s']:6.1f} s"
            f"   total {r['ours_s']:6.1f} s {_runs(o)}  reloaded max rel diff {o['reloaded_max_rel_diff']:.1e}"
        )
        m = r.get("ours_memory")
        if m:
            print(
                f"  ours mem   write {m['write_s']:5.1f} s                          load {m['load_s']:6.1f} s"
                f"   total {r['ours_memory_s']:6.1f} s {_runs(m)}  reloaded max rel diff "
                f"{m['reloaded_max_rel_diff']:.1e}   (off the critical path: files allocated ahead "
                f"{m['allocate_s']:.1f} s, persist {m['persist_s']:.1f} s)"
            )
        print(
            f"  DeepSpeed  save {d['save_s']:6.1f} s  ds_to_universal {d['convert_s']:6.1f} s "
            f"(+{d['startup_s']:.1f} s start)  load {d['load_s']:6.1f} s   total {r['deepspeed_s']:6.1f} s {_runs(d)}  "
            f"reloaded max rel diff {d['reloaded_max_rel_diff']:.1e}"
        )
        print(
            f"  ratio deepspeed/ours {r['ratio']:.2f}"
            + (f", deepspeed/ours through memory {r['ratio_memory']:.2f}" if "ratio_memory" in r else "")
            + f"   (same initial weights: max rel diff {r['initial_weights_max_rel_diff']:.1e})"
        )
    st = results.get("step_time")
    if st:
        print(
            f"\nstep time {st['model']}, global batch {st['global_batch']} x {st['seq_len']} tokens, "
            f"micro-batch {st['micro_batch']}, 4 ranks (medians)"
        )
        for name, c in st["cases"].items():
            print(
                f"  {name:<44} ours {c['ours_s']:6.2f} s   DeepSpeed {c['deepspeed_s']:6.2f} s   ratio {c['ratio']:.2f}"
            )


if __name__ == "__main__":
    main()
