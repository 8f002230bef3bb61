#!/usr/bin/env bash
# Mutation testing (issue 15): mutmut 3 on the modules whose behaviour the fast tests pin down, then the score.
#
#   scripts/mutation.sh                    # all of them: parallel/, checkpoint/, plan/memory.py, train/, data/order.py
#   scripts/mutation.sh elastic_trainer/data/order.py elastic_trainer/plan/memory.py   # only these
#   scripts/mutation.sh --report-only [MODULE ...]                                     # score the last results
#   scripts/mutation.sh --not-killed [MODULE ...]   # run again every mutant not killed (after adding tests)
#   scripts/mutation.sh --names GLOB ...            # these mutants (mutmut's names: elastic_trainer.data.order.x_f__mutmut_*)
#   scripts/mutation.sh --names - < FILE             # the globs in FILE, one a line (scripts/mutation_diff.py select)
#
# The configuration is [tool.mutmut] in pyproject.toml: what gets mutants (only_mutate), the tests (tests/unit and
# tests/distributed and one e2e file; less the structure check), the timeout, the fork server. mutmut
# copies the tree into mutants/, collects which tests reach which function (once; cached in mutants/), then
# runs each mutant with only those tests, fastest first, stopping at the first failure.
#   - No arguments: an incremental run; only mutants of functions changed since the last run are run again.
#   - With modules: every mutant of those modules is run again (mutmut reruns the mutants it is named).
# Afterwards scripts/mutation_report.py prints killed/total per module, the survivors by name and the score,
# with the equivalent mutants of scripts/mutation_equivalent.txt set aside.
#
# Environment: MUTATION_JOBS (mutants tested at once, default 1: the distributed tests fork 2-8 ranks each),
# MUTATION_FRESH=1 (delete mutants/ first), MUTATION_TEST_BUDGET_S (seconds of clean test time per mutant, default 15;
# see scripts/mutmut_plugin.py),
# MUTATION_MIN_SCORE (exit 1 below this percentage), OMP_NUM_THREADS (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh dev,mutation
MUTMUT="$(dirname "$ET_PY")/mutmut"

report_only=0
not_killed=0
given_names=()
if [ "${1:-}" = "--report-only" ]; then
    report_only=1
    shift
elif [ "${1:-}" = "--not-killed" ]; then
    not_killed=1
    shift
elif [ "${1:-}" = "--names" ]; then
    shift
    if [ "${1:-}" = "-" ]; then
        mapfile -t given_names
    else
        given_names=("$@")
    fi
    [ ${#given_names[@]} -gt 0 ] || { echo "mutation.sh: --names needs mutant-name globs" >&2; exit 2; }
    set --
fi

DEFAULT_MODULES=(elastic_trainer/parallel/ elastic_trainer/checkpoint/ elastic_trainer/plan/memory.py
                 elastic_trainer/train/ elastic_trainer/data/order.py)
modules=("$@")
[ ${#modules[@]} -eq 0 ] && modules=("${DEFAULT_MODULES[@]}")

if [ "$report_only" = 0 ]; then
    # mutant-name globs: elastic_trainer/data/order.py -> elastic_trainer.data.order.*
    names=()
    for m in "$@"; do
        [ -e "$m" ] || { echo "mutation.sh: no such module: $m" >&2; exit 2; }
        m="${m%/}"
        m="${m%.py}"
        m="${m%/__init__}"
        names+=("${m//\//.}.*")
    done
    [ ${#given_names[@]} -gt 0 ] && names=("${given_names[@]}")
    [ "${MUTATION_FRESH:-0}" = 1 ] && rm -rf mutants
    if [ "$not_killed" = 1 ]; then
        # mutmut keeps a survivor's or a "no tests" verdict until its function changes; new tests only reach
        # it when it is named. Tests added since the last run get their coverage collected first.
        mapfile -t names < <("$ET_PY" scripts/mutation_report.py --list-not-killed "${modules[@]}")
        if [ ${#names[@]} -eq 0 ]; then
            echo "[mutation] every mutant is killed or set aside"
            exec "$ET_PY" scripts/mutation_report.py "${modules[@]}"
        fi
        echo "[mutation] running ${#names[@]} mutants again"
    fi
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
    start=$(date +%s)
    # mutmut's exit status is 0 whatever survives; the report below decides. When its stats or clean run
    # fails it hides pytest's output (the fork server); scripts/mutmut_plugin.py keeps the failed tests.
    rm -f mutants/mutation-failures.txt
    if ! "$MUTMUT" run --max-children "${MUTATION_JOBS:-1}" "${names[@]}"; then
        if [ -s mutants/mutation-failures.txt ]; then
            echo "[mutation] mutmut failed; the tests that failed inside mutants/:" >&2
            cat mutants/mutation-failures.txt >&2
        else
            echo "[mutation] mutmut failed; to see a failing test, run the selection of [tool.mutmut] in" \
                 "mutants/: (cd mutants && MUTANT_UNDER_TEST=stats PYTHONPATH=. $ET_PY -m pytest -p" \
                 "scripts.mutmut_plugin -n 2 --dist loadfile tests/unit tests/distributed" \
                 "tests/e2e/test_metrics_pipe.py --deselect ...)" >&2
        fi
        exit 1
    fi
    echo "[mutation] mutmut run took $(( $(date +%s) - start )) s"
fi

exec "$ET_PY" scripts/mutation_report.py "${modules[@]}" \
    ${MUTATION_MIN_SCORE:+--min-score "$MUTATION_MIN_SCORE"}
