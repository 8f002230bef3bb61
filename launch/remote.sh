#!/usr/bin/env bash
# Runs on a remote host, started over ssh by `elastic-trainer launch`:
#
#   launch/remote.sh env K=V ... /path/.venv/bin/python -m elastic_trainer.launch.agent ...
#
# Goes to this project folder, puts its .venv first on PATH, runs the command, and stops it (SIGUSR2: the
# torchrun agent then stops its workers, which save; SIGTERM would be a scheduler's notice to the launcher)
# when the launcher's connection ends: ssh without a tty never signals the remote command, but our stdin closes.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
if [ ! -x "$root/.venv/bin/python" ]; then
    echo "remote.sh: $root/.venv is missing on $(hostname); run ./run.sh --help there once to set it up" >&2
    exit 2
fi
export VIRTUAL_ENV="$root/.venv" PATH="$root/.venv/bin:$PATH"

exec 3<&0  # the launcher's end of the connection (a background job's own stdin would be /dev/null)
"$@" </dev/null 3<&- &
agent=$!
# The watcher reads fd 3 until the launcher goes away, then stops the agent. It holds neither stdout nor
# stderr, so it never keeps the ssh session open by itself.
( while read -r -u 3 _; do :; done; kill -USR2 "$agent" 2>/dev/null ) </dev/null >/dev/null 2>&1 &
watcher=$!
wait "$agent"
code=$?
kill "$watcher" 2>/dev/null
exit "$code"
