"""Where one training step's device time goes on one GPU: torch.profiler over one step after two, the kernels
grouped by name, largest first (the step-time model's terms are checked against this). The committed
results/NVIDIA-H200/profile-*.txt were printed before the kernels were told apart from the ops that launch
them: their totals and percentages count both.

    python benchmarks/gpu/profile_step.py --model gpt3-small --mode zero1 --micro-batch 8 [--top 25]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from elastic_trainer.config import load_model_config  # noqa: E402
from elastic_trainer.parallel import init_process_group  # noqa: E402
from elastic_trainer.parallel.calibrate_modes import probe_trainer  # noqa: E402
from elastic_trainer.plan.layout import Layout  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt3-small")
    p.add_argument("--mode", default="zero1")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    init_process_group(device, distributed=False)
    layout = Layout(1, 1, 1, args.micro_batch, args.global_batch // args.micro_batch, dp_mode=args.mode)
    trainer = probe_trainer(load_model_config(args.model), layout, args.seq_len, device, "bf16" if gpu else "fp32", 3)
    for _ in range(2):
        trainer.train_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        trainer.train_step()
        if gpu:
            torch.cuda.synchronize()
    from torch.autograd import DeviceType

    if gpu:  # the kernels themselves: an op's row would count its kernels' time a second time
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    else:
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    key = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
    total = sum(key(e) for e in events)
    print(
        f"{args.model} {args.mode} micro-batch {args.micro_batch} x {layout.num_microbatches}: "
        f"{total / 1e3:.1f} ms of {'device' if gpu else 'CPU'} time in one step"
    )
    for e in sorted(events, key=key, reverse=True)[: args.top]:
        print(f"  {key(e) / 1e3:8.2f} ms {100 * key(e) / total:5.1f} %  x{e.count:<5d} {e.key[:110]}")


if __name__ == "__main__":
    main()
