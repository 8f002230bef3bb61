#!/usr/bin/env bash
# Set up what the tests need (first run only), then run the whole test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/unit -x. The tests run on ET_TEST_WORKERS
# pytest-xdist workers (default 3; a file stays on one worker; ET_TEST_WORKERS=0 runs them in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh dev,deepspeed
exec "$ET_PY" -m pytest -q -n "${ET_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
