# Sourced by run.sh and scripts/test.sh: make a virtual environment that can run the project.
#
#   source scripts/setup.sh [EXTRAS]      # EXTRAS: "", "dev", "bench" or "dev,bench"; "deepspeed" among them
#                                         # also installs DeepSpeed (optional: its tests skip without it)
#
# Afterwards $ET_PY is the interpreter to use. What it does, each step only when needed:
#   1. create $ET_VENV (default .venv) with access to the system's packages, so a GPU machine's
#      own CUDA torch is used as it is;
#   2. when that interpreter has no torch, install the CPU wheel torch==2.13.0 (a pinned version,
#      so pip takes the local wheel instead of downloading a multi-GB CUDA build);
#   3. install this project (editable) with EXTRAS, again only when pyproject.toml changed.
# Environment: PYTHON (interpreter that creates the venv, default python3), ET_VENV.

ET_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ET_VENV="${ET_VENV:-$ET_ROOT/.venv}"
_et_extras="${1:-}"
_et_deepspeed=0
case ",$_et_extras," in
    *,deepspeed,*)
        _et_deepspeed=1
        _et_extras="$(echo ",$_et_extras," | sed 's/,deepspeed,/,/; s/^,//; s/,$//')" ;;
esac
DEEPSPEED_SPEC="${DEEPSPEED_SPEC:-deepspeed==0.19.8}"

_et_log() { echo "[setup] $*" >&2; }

_et_setup() {
    local base_py="${PYTHON:-python3}"
    if ! command -v "$base_py" >/dev/null 2>&1; then
        _et_log "error: '$base_py' not found; install Python >= 3.10 or set PYTHON=/path/to/python"
        return 1
    fi
    if ! "$base_py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        _et_log "error: $("$base_py" --version 2>&1) is too old; Python >= 3.10 is required"
        return 1
    fi
    if [ ! -x "$ET_VENV/bin/python" ]; then
        _et_log "creating virtual environment $ET_VENV"
        "$base_py" -m venv --system-site-packages "$ET_VENV" || return 1
    fi
    ET_PY="$ET_VENV/bin/python"
    if ! "$ET_PY" -c 'import torch' >/dev/null 2>&1; then
        _et_log "no torch found: installing the CPU wheel torch==2.13.0"
        "$ET_PY" -m pip install -q "torch==2.13.0" || return 1
    fi
    local spec="$ET_ROOT"
    [ -n "$_et_extras" ] && spec="$ET_ROOT[$_et_extras]"
    local stamp="$ET_VENV/.elastic_trainer.${_et_extras:-core}.sha256"
    local want
    want="$(cat "$ET_ROOT/pyproject.toml" | sha256sum | cut -c1-64)"
    local have
    have="$(cat "$stamp" 2>/dev/null)"
    if [ -z "$_et_extras" ] && [ "$have" != "$want" ]; then
        # an install with extras (test.sh's "dev") includes the core one
        grep -qxF "$want" "$ET_VENV"/.elastic_trainer.*.sha256 2>/dev/null && have="$want"
    fi
    if [ "$have" != "$want" ] \
        || ! "$ET_PY" -c 'import elastic_trainer' >/dev/null 2>&1; then
        _et_log "installing elastic-trainer${_et_extras:+[$_et_extras]} (editable)"
        "$ET_PY" -m pip install -q -e "$spec" || return 1
        echo "$want" >"$stamp"
    fi
    # DeepSpeed builds against the installed torch (hence no build isolation); optional: a failure is reported,
    # and its tests and benchmarks skip saying how to install it.
    if [ "$_et_deepspeed" = 1 ] && ! "$ET_PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("deepspeed") is None)'; then
        _et_log "installing $DEEPSPEED_SPEC (--no-build-isolation; for the DeepSpeed import tests and benchmarks)"
        "$ET_PY" -m pip install -q --no-build-isolation "$DEEPSPEED_SPEC" \
            || _et_log "warning: DeepSpeed did not install; its tests will skip (pip install --no-build-isolation $DEEPSPEED_SPEC)"
    fi
    # DeepSpeed compiles its shared-memory collective op the first time a process group uses it (about a minute
    # of gcc on 2 cores): build it here, once per environment, so no test or job pays it.
    local ops_stamp="$ET_VENV/.deepspeed_ops_built"
    if [ "$_et_deepspeed" = 1 ] && [ ! -e "$ops_stamp" ] \
        && "$ET_PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("deepspeed") is None)'; then
        _et_log "building DeepSpeed's shared-memory collective op (once; about a minute)"
        # A bound: torch's build lock (~/.cache/torch_extensions/.../lock) outlives a build that was killed, and
        # every later build waits on it without end; past the bound the set-up goes on with the warning below.
        if timeout 900 "$ET_PY" -c '
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
builder is None or builder.load()' >"$ET_VENV/.deepspeed_ops_build.log" 2>&1; then
            touch "$ops_stamp"
        else
            _et_log "warning: it did not build in 15 min ($ET_VENV/.deepspeed_ops_build.log; a hang there is a" \
                "killed build's lock under ~/.cache/torch_extensions, delete it); DeepSpeed builds it when first used"
        fi
    fi
}

_et_setup || { _et_log "set-up failed"; return 1 2>/dev/null || exit 1; }
export ET_PY ET_ROOT
