"""The GPU check-up: the trainer's GPU path on whatever GPUs this machine has, in one command.

    python benchmarks/gpu/checkup.py                  # on a CUDA machine: GPT-3 XL, bf16, NCCL (~10-20 min)
    python benchmarks/gpu/checkup.py --smoke          # anywhere: the same code paths, small (what CI runs)

Every case is a real job, `elastic-trainer torchrun --standalone --nproc-per-node N train ...`: TorchElastic's
agent with our worker fork (the agent never touches CUDA; its workers are forked from it), then the process
group (NCCL on GPUs, gloo on CPU), the layout's wrappers and a few steps of training on the packaged corpus.
1. **layouts**: every data-parallel mode (fsdp, ddp, zero1) across all GPUs, then tensor and pipeline
   parallelism across them where the GPU count allows (2 or more);
2. **micro-batch sweep** on one GPU, eager and compiled (`--compile`): step time and model FLOPs utilization
   (MFU, against the GPU's data-sheet bf16 peak);
3. beside every measured step time and peak memory (`torch.cuda.max_memory_allocated`, the largest of any
   rank), the planner's prediction for the same layout from the GPU's hardware profile;
4. `elastic-trainer calibrate --compile`: a measured hardware profile of this machine (`profile.toml`), to
   compare with or replace the data-sheet profile the predictions used.
It prints one table and writes `checkup.json` (and every job's log and metrics) into `--out`.

Without a GPU it runs the same cases on CPU ranks (gpt-tiny, fp32, gloo, short sequences) and says that the
figures are not GPU figures: that form checks the kit and the paths it drives, nothing about GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from elastic_trainer.config import load_model_config  # noqa: E402
from elastic_trainer.plan import Request, hardware_for_device, load_hardware  # noqa: E402
from elastic_trainer.plan.candidates import evaluate  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402

PEAK_BF16_TFLOPS = {"h100": 989.4, "h200": 989.4, "a100": 312.0, "l40s": 362.1}
"""Dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts), the denominator of MFU."""
NOT_GPU = (
    "NOT GPU FIGURES: this machine has no CUDA device, so the check-up ran its CPU form (gpt-tiny, fp32, "
    "gloo ranks on the CPU cores) to exercise its code paths. Run it on a GPU machine for GPU figures."
)


@dataclass(frozen=True)
class Setup:
    gpu: bool
    device_name: str
    gpus: int
    model: str
    seq_len: int
    global_batch: int
    steps: int
    dtype: str
    hardware: str
    sweep: tuple[int, ...]
    timeout_s: int


@dataclass
class Case:
    name: str
    ranks: int
    layout: tuple[int, int, int]
    dp_mode: str
    micro_batch: int
    compile: bool = False
    result: dict = field(default_factory=dict)


def detect(args) -> Setup:
    """GPUs when CUDA has any (counted here; the agent forks the workers later, which is why nothing else in
    this process touches CUDA), else CPU ranks. `--smoke` or no GPU: the small form."""
    import torch

    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if gpu else "cpu"
    small = args.smoke or not gpu
    gpus = torch.cuda.device_count() if gpu else 2
    return Setup(
        gpu,
        name,
        gpus,
        args.model or ("gpt-tiny" if small else "gpt3-xl"),
        args.seq_len or (32 if small else 2048),
        args.global_batch or math.lcm(4 if small else 8, gpus),
        args.steps or (3 if small else 6),
        "bf16" if gpu else "fp32",
        args.hardware or hardware_for_device("cuda" if gpu else "cpu", name).name,
        tuple(args.sweep) if args.sweep else (1, 2) if small else (1, 2, 4, 8),
        300 if small else 900,
    )


def cases(s: Setup) -> list[Case]:
    n, model, batch = s.gpus, load_model_config(s.model), s.global_batch

    def micro(dp: int, wanted: int) -> int:
        """The largest micro-batch up to `wanted` that splits a dp rank's share of the batch evenly."""
        share = batch // dp
        return max(m for m in range(1, max(1, min(wanted, share)) + 1) if share % m == 0)

    out = [Case(f"dp{n} {mode}", n, (n, 1, 1), mode, micro(n, 2)) for mode in ("fsdp", "ddp", "zero1")]
    if n >= 2 and model.n_heads % n == 0:
        out.append(Case(f"tp{n}", n, (1, n, 1), "fsdp", micro(1, 2)))
    if n >= 2 and model.n_layers >= n:
        out.append(Case(f"pp{n}", n, (1, 1, n), "fsdp", micro(1, max(1, batch // (2 * n)))))
    if n >= 4 and n % 2 == 0 and model.n_heads % 2 == 0:
        out.append(Case(f"dp{n // 2} x tp2 zero1", n, (n // 2, 2, 1), "zero1", micro(n // 2, 2)))
    for compiled in (False, True):
        for mb in s.sweep:
            if batch % mb == 0:
                out.append(
                    Case(
                        f"1 {'GPU' if s.gpu else 'rank'} mb{mb}" + (" compiled" if compiled else ""),
                        1,
                        (1, 1, 1),
                        "fsdp",
                        mb,
                        compile=compiled,
                    )
                )
    return out


def run_case(case: Case, s: Setup, out: Path) -> None:
    folder = out / case.name.replace(" ", "-")
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "elastic_trainer.cli",
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        str(case.ranks),
        "train",
        "--model",
        s.model,
        "--layout",
        ",".join(map(str, case.layout)),
        "--dp-mode",
        case.dp_mode,
        "--micro-batch",
        str(case.micro_batch),
        "--global-batch",
        str(s.global_batch),
        "--seq-len",
        str(s.seq_len),
        "--steps",
        str(s.steps),
        "--dtype",
        s.dtype,
        "--hardware",
        s.hardware,
        "--metrics-file",
        str(metrics),
        "--seed",
        "0",
    ]
    if case.compile:
        argv += ["--compile", "--compile-cache", str(out / "compile-cache")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not s.gpu:
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=s.timeout_s)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, code = f"{e.stdout or ''}{e.stderr or ''}\n(timed out after {s.timeout_s} s)", None
    (folder / "log.txt").write_text(log)
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    case.result = {
        "returncode": code,
        "wall_s": round(time.perf_counter() - t0, 2),
        "log": str(folder / "log.txt"),
        "ok": code == 0 and len(records) == s.steps,
    }
    if not case.result["ok"]:
        tail = [line for line in log.splitlines() if line.strip()][-3:]
        case.result["why"] = "out of memory" if "out of memory" in log.lower() else " | ".join(tail)[-300:]
    if records:
        times = [r["step_time_s"] for r in records]
        case.result.update(
            first_step_s=times[0],
            step_s=statistics.median(times[1:] or times),
            final_loss=records[-1]["loss"],
            max_memory_gib=records[-1].get("max_memory_gib"),
        )
    predict(case, s)


def predict(case: Case, s: Setup) -> None:
    """The planner's step time and peak memory per rank for the case's layout, and the measured MFU."""
    model, hw = load_model_config(s.model), load_hardware(s.hardware)
    dp, tp, pp = case.layout
    layout = Layout(dp, tp, pp, case.micro_batch, s.global_batch // (dp * case.micro_batch), case.dp_mode)
    request = Request(
        model, case.ranks, s.global_batch, s.seq_len, hw, case.ranks, dtype=s.dtype, compiled=case.compile
    )
    planned = evaluate(request, layout)  # what the planner ranks this layout by
    case.result["predicted_step_s"], case.result["predicted_memory_gib"] = planned.step_time_s, planned.memory_gb
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in s.device_name.lower()), None) if s.gpu else None
    if peak and case.result.get("step_s"):
        tokens = s.global_batch * s.seq_len
        flops = tokens * (6 * model.num_params() + 12 * model.n_layers * model.d_model * s.seq_len)
        case.result["mfu"] = flops / case.result["step_s"] / (case.ranks * peak * 1e12)


def calibrate(s: Setup, out: Path) -> dict:
    profile = out / "profile.toml"
    argv = [
        sys.executable,
        "-m",
        "elastic_trainer.cli",
        "calibrate",
        "--output",
        str(profile),
        "--name",
        f"checkup-{'gpu' if s.gpu else 'cpu'}",
        "--ranks",
        "2",
        "--compile",
    ]  # ranks: CPU links only
    if s.gpu:
        argv += ["--base", s.hardware]  # on a GPU the links are kept from the data-sheet profile
    proc = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    (out / "calibrate.log").write_text(proc.stdout + proc.stderr)
    result = {"returncode": proc.returncode, "profile": str(profile) if proc.returncode == 0 else None}
    if proc.returncode == 0:
        measured, sheet = load_hardware(str(profile)), load_hardware(s.hardware)
        result["compare"] = {
            k: (getattr(sheet, k), getattr(measured, k))
            for k in ("tflops", "head_tflops", "layer_overhead_ms", "memory_bandwidth_gbs", "compiled_speedup")
        }
    return result


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(all_cases: list[Case], s: Setup) -> list[str]:
    head = (
        f"{'case':22s} {'ranks':>5s} {'step s':>8s} {'planned':>8s} {'ratio':>6s} {'peak GiB':>9s} "
        f"{'planned':>8s} {'MFU':>6s} {'1st step':>8s}  result"
    )
    lines = [head, "-" * len(head)]
    for c in all_cases:
        r = c.result
        ratio = r["step_s"] / r["predicted_step_s"] if r.get("step_s") and r.get("predicted_step_s") else None
        lines.append(
            f"{c.name:22s} {c.ranks:5d} {fmt(r.get('step_s'), '8.3f'):>8s} "
            f"{fmt(r.get('predicted_step_s'), '8.3f'):>8s} {fmt(ratio, '6.2f'):>6s} "
            f"{fmt(r.get('max_memory_gib'), '9.2f', 'n/a' if not s.gpu else '-'):>9s} "
            f"{fmt(r.get('predicted_memory_gib'), '8.2f'):>8s} {fmt(r.get('mfu'), '6.1%'):>6s} "
            f"{fmt(r.get('first_step_s'), '8.2f'):>8s}  {'ok' if r['ok'] else 'FAILED: ' + r['why']}"
        )
    return lines


def write_report(
    out: Path, s: Setup, done: list[Case], cal: dict | None, complete: bool, lines: list[str] | None = None
) -> None:
    report = {
        "setup": dataclasses.asdict(s),
        "gpu_figures": s.gpu,
        "note": None if s.gpu else NOT_GPU,
        "complete": complete,
        "cases": [
            {
                "name": c.name,
                "ranks": c.ranks,
                "layout": c.layout,
                "dp_mode": c.dp_mode,
                "micro_batch": c.micro_batch,
                "compile": c.compile,
                **c.result,
            }
            for c in done
        ],
        "calibrate": cal,
        "table": lines if lines is not None else table(done, s),
    }
    tmp = out / "checkup.json.tmp"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out / "checkup.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the small form (gpt-tiny, short sequences) on the GPUs too; without a GPU it is always the form",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu" / "results"), help="folder for the results")
    p.add_argument("--model", help="model preset (default gpt3-xl on GPUs, gpt-tiny on CPU)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--global-batch", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--hardware", help="profile the predictions use (default: the one matching the GPU; cpu)")
    p.add_argument("--no-calibrate", action="store_true", help="skip `calibrate` (it takes minutes)")
    p.add_argument(
        "--sweep",
        type=lambda v: [int(x) for x in v.split(",")],
        help="micro-batch sizes of the one-device sweep (default 1,2,4,8 on GPUs; 1,2 small)",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only the case of this name (repeatable; e.g. --only 'dp2 fsdp' --only '1 GPU mb2 compiled')",
    )
    args = p.parse_args(argv)
    s = detect(args)
    out = Path(args.out) / (s.device_name.replace(" ", "-") if s.gpu else "cpu-form")
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"[checkup] {s.gpus} x {s.device_name}: {s.model}, {s.dtype}, seq {s.seq_len}, global batch "
        f"{s.global_batch}, {s.steps} steps per case; predictions from hardware profile {s.hardware!r}",
        flush=True,
    )
    if not s.gpu:
        print(f"[checkup] {NOT_GPU}", flush=True)
    all_cases = [c for c in cases(s) if not args.only or c.name in args.only]
    if not all_cases:
        p.error(f"no case matches --only {args.only}: the cases are {', '.join(c.name for c in cases(s))}")
    for done, case in enumerate(all_cases, 1):
        run_case(case, s, out)
        print(
            f"[checkup] {case.name}: {'ok' if case.result['ok'] else 'FAILED'} in {case.result['wall_s']:.1f} s",
            flush=True,
        )
        write_report(out, s, all_cases[:done], None, complete=False)  # a killed check-up keeps what it measured
    cal = None if args.no_calibrate else calibrate(s, out)
    lines = table(all_cases, s)
    print("\n".join(lines))
    if cal is not None:
        print(f"[checkup] calibrate: {'wrote ' + cal['profile'] if cal['profile'] else 'FAILED, see calibrate.log'}")
        for k, (sheet, measured) in cal.get("compare", {}).items():
            print(f"  {k:22s} profile {s.hardware}: {sheet:10.4g}   measured here: {measured:10.4g}")
    if not s.gpu:
        print(f"[checkup] {NOT_GPU}")
    write_report(out, s, all_cases, cal, complete=True, lines=lines)
    print(f"[checkup] wrote {out / 'checkup.json'}")
    return 0 if all(c.result["ok"] for c in all_cases) and (cal is None or cal["profile"]) else 1


if __name__ == "__main__":
    sys.exit(main())
