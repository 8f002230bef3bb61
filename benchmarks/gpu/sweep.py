"""One GPU, one process, many layouts: the step-time model's figures on a GPU across model sizes.

    python benchmarks/gpu/sweep.py --out sweep.json                  # on a CUDA machine (~4-5 min on an H200)
    python benchmarks/gpu/sweep.py --smoke --out /tmp/sweep.json     # anywhere: gpt-tiny on the CPU (what CI runs)

For each model (GPT-3 XL, medium, small by default), each data-parallel mode (fsdp, ddp, zero1 on a group of
one) and each micro-batch size (1, 2, 4, 8 of a global batch of 8 at sequence 2048): the trainer's own step
(`train.loop.Trainer`, bf16, NCCL), the median of `--steps` steps after `--warmup`, each ended by a device
synchronization. Before them, per model and mode, the **host probe**: the same model at sequence
`--probe-seq` (64), micro-batch 1 x 8, where the device has almost nothing to do, so that a step takes what the
host needs to issue it (Python, the modules' and the data-parallel wrappers' hooks, kernel launches).

The cases run in one process (the check-up's starts one job per case: ~10 s each): one CUDA context, one
process group of one. `--out` is rewritten after every case, so a run stopped at a time limit keeps what it
measured. The planner's predictions are not made here (the profile they need is what this measures):
`benchmarks/gpu/predict.py` sets the step-time model beside them.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from elastic_trainer.config import load_model_config  # noqa: E402
from elastic_trainer.model import gpt  # noqa: E402
from elastic_trainer.parallel import init_process_group  # noqa: E402
from elastic_trainer.parallel.calibrate_modes import timed_steps  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402


def case_list(models, modes, micro_batches, global_batch, seq_len, probe_seq) -> list[dict]:
    """Per model: the host probe of every mode, then the micro-batch sweep, the sizes nearest the check-up's
    first case (micro-batch 2) first."""
    order = sorted(micro_batches, key=lambda m: (abs(m - 2), m))
    cases = []
    for model in models:
        cases += [dict(model=model, mode=mode, micro_batch=1, seq_len=probe_seq, probe=True) for mode in modes]
        cases += [
            dict(model=model, mode=mode, micro_batch=mb, seq_len=seq_len, probe=False)
            for mb in order
            if global_batch % mb == 0
            for mode in modes
        ]
    return cases


def run_case(case: dict, global_batch: int, steps: int, warmup: int, device: torch.device, dtype: str) -> dict:
    layout = Layout(1, 1, 1, case["micro_batch"], global_batch // case["micro_batch"], dp_mode=case["mode"])
    r = timed_steps(load_model_config(case["model"]), layout, case["seq_len"], device, dtype, steps, warmup)
    out = dict(
        case,
        global_batch=global_batch,
        num_microbatches=layout.num_microbatches,
        dtype=dtype,
        parameters=r["parameters"],
        build_s=round(r["build_s"], 3),
        step_s=round(r["step_s"], 6),
        steps_s=[round(t, 6) for t in r["steps_s"]],
        phases_s={k: round(v, 6) for k, v in r["phases_s"].items()},
        loss=r["loss"],
    )
    if "max_memory_gib" in r:
        out["max_memory_gib"] = round(r["max_memory_gib"], 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt3-xl,gpt3-medium,gpt3-small")
    p.add_argument("--modes", default="fsdp,ddp,zero1")
    p.add_argument("--micro-batches", default="1,2,4,8", help="'' for the host probes alone")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--probe-seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="measured steps per case")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per case")
    p.add_argument(
        "--vocab-pad",
        type=int,
        default=None,
        help="pad the head's GEMMs to a multiple of this many rows (model.gpt.VOCAB_PAD_MULTIPLE; 1: off)",
    )
    p.add_argument("--smoke", action="store_true", help="gpt-tiny on the CPU, sequence 32: checks the script")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    if args.smoke:
        args.models, args.seq_len, args.probe_seq, args.steps, args.warmup = "gpt-tiny", 32, 8, 2, 1
    if args.vocab_pad is not None:
        if args.vocab_pad < 1:
            p.error("--vocab-pad must be >= 1")
        gpt.VOCAB_PAD_MULTIPLE["cuda"] = args.vocab_pad
    init_process_group(device, distributed=False)
    cases = case_list(
        args.models.split(","),
        args.modes.split(","),
        [int(m) for m in args.micro_batches.split(",") if m],
        args.global_batch,
        args.seq_len,
        args.probe_seq,
    )
    header = dict(
        device=torch.cuda.get_device_name(0) if gpu else "cpu",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        gpu=gpu,
        vocab_pad=gpt.VOCAB_PAD_MULTIPLE.get(device.type, 1),
        date=time.strftime("%Y-%m-%d"),
        cases=[],
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    for case in cases:
        try:
            result = run_case(case, args.global_batch, args.steps, args.warmup, device, "bf16" if gpu else "fp32")
        except Exception as e:  # noqa: BLE001 - an out-of-memory case is a finding, the sweep goes on
            result = dict(case, error=f"{type(e).__name__}: {str(e)[:300]}")
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        header["cases"].append(result)
        out.write_text(json.dumps(header, indent=1))
        shown = f"{result['step_s']:.4f} s" if "step_s" in result else result["error"]
        print(
            f"[sweep] {time.perf_counter() - t_start:6.1f}s {case['model']:12s} {case['mode']:5s} "
            f"mb {case['micro_batch']} seq {case['seq_len']}{' probe' if case['probe'] else ''}: {shown}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
