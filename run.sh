#!/usr/bin/env bash
# The user's entry point: set up on first use, then run the elastic job on the hosts of hosts.txt.
#
#   ./run.sh                  # the default job: gpt-tiny on localhost ranks through 4 -> 8 -> 2 -> 4 ranks,
#                             # then a phase table and runs/default/loss.png (about a minute on 2 CPU cores)
#   ./run.sh --resume         # after a crash: continue from the newest complete checkpoint
#   nohup ./run.sh > run.log 2>&1 &   # keep it running after the terminal closes (closing it otherwise stops
#                                     # the job with a save; each host's output is in runs/default/hosts/)
#   ./run.sh --dry-run        # print the plan and the command each host would start; start nothing
#   ./run.sh --hosts cluster.txt --gpus-per-host 8 --model gpt3-xl --schedule none -- --global-batch 128
#
# All of it is `elastic-trainer launch` (./run.sh --help lists every option); arguments after -- go to
# `elastic-trainer train` on every rank. hosts.txt and runs/ are this folder's unless you name others.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$root/scripts/setup.sh" ""  # core install (an explicit "": `source` would pass our arguments on)
exec "$ET_PY" -m elastic_trainer.cli launch --hosts "$root/hosts.txt" --run-dir "$root/runs/default" "$@"
