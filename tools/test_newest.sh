#!/usr/bin/env bash
# The test suite against the newest releases (docs/guide/versions.md, "Drift"): a fresh virtual environment with
# torch's CPU pin and nothing else pinned (not .ci/constraints.txt), then what .ci/run runs after its installs
# (`ruff check . && python -m pytest`), on empty caches as on a fresh machine. It prints and keeps its result.
#
#   tools/test_newest.sh                  run; keep everything in $HF_OPTIM_NEWEST_DIR (default /tmp/hf_optim-newest)
#   tools/test_newest.sh --refresh-lock   the same, then, if it passed, write its versions to .ci/constraints.txt
#   tools/test_newest.sh --lock-from DIR  no run: write .ci/constraints.txt from the passing run kept in DIR
#
# In the directory: result.txt (date, commit, machine, versions, counts, durations, status), freeze.txt (every
# installed version), install.log, tests.log, venv/ and cache/. Exit status: the tests' (0: passed).
# PYTHON picks the interpreter of the new environment (default python3). pip's own settings apply as usual (this
# repository's machines cap torch<=2.14.1 in /etc/xdg/pip/constraints.txt; torch is pinned below that anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOCK=${HF_OPTIM_LOCK:-.ci/constraints.txt}  # (tests write a lock elsewhere)
TORCH_PIN=$(grep -o 'torch==[^ ]*' .ci/run | head -n 1)  # the README's and CI's: the CPU build

write_lock() {  # DIR: the kept run whose freeze.txt becomes the lock
    local dir=$1
    if ! grep -qx 'status: passed' "$dir/result.txt" 2>/dev/null; then
        echo "error: $dir holds no passing run (result.txt says: $(grep '^status:' "$dir/result.txt" 2>/dev/null ||
              echo 'nothing')); the lock is written only from a run that passed" >&2
        return 1
    fi
    {
        echo "# The versions the test suite passed with: the README's test command and .ci/run install them"
        echo "# (pip install -c .ci/constraints.txt). Written by tools/test_newest.sh from the run against the newest releases of"
        echo "# $(sed -n 's/^date: //p' "$dir/result.txt") at $(sed -n 's/^commit: //p' "$dir/result.txt"):"
        echo "# $(sed -n 's/^pytest: //p' "$dir/result.txt")"
        echo "# on $(sed -n 's/^machine: //p' "$dir/result.txt")."
        echo "# torch: the CPU build the README's first command installs ($TORCH_PIN; the build's local label, such as"
        echo "# +cpu, is left out: a pin with it would refuse the same release installed from another index)."
        grep -v -i -E '^(hf[-_]optim|-e |pip==)' "$dir/freeze.txt" | sed -E 's/^(torch==[^+]+)\+.*$/\1/'
    } > "$LOCK.new"
    mv "$LOCK.new" "$LOCK"
    echo "wrote $LOCK ($(grep -c -v '^#' "$LOCK") pins) from $dir"
}

refresh=0
case "${1:-}" in
    --lock-from) write_lock "${2:?--lock-from needs the directory of a passing run}"; exit ;;
    --refresh-lock) refresh=1 ;;
    "") ;;
    *) echo "error: unknown option '$1' (valid: --refresh-lock, --lock-from DIR)" >&2; exit 2 ;;
esac

OUT=${HF_OPTIM_NEWEST_DIR:-/tmp/hf_optim-newest}
rm -rf "$OUT"
mkdir -p "$OUT/cache"
OUT=$(cd "$OUT" && pwd)
started=$(date +%s)
load=$(cut -d ' ' -f 1-3 /proc/loadavg 2>/dev/null || echo unknown)

"${PYTHON:-python3}" -m venv "$OUT/venv"
# shellcheck disable=SC1091
. "$OUT/venv/bin/activate"
echo "installing the newest releases into $OUT/venv (log: $OUT/install.log)"
{ pip install "$TORCH_PIN" && pip install -e ".[test]"; } > "$OUT/install.log" 2>&1 ||
    { tail -n 20 "$OUT/install.log"; echo "error: the install failed (log: $OUT/install.log)" >&2; exit 1; }
pip freeze --all --exclude-editable > "$OUT/freeze.txt"  # --all: setuptools too (torch requires it)
installed=$(date +%s)

# a fresh machine: offline, nothing compiled or downloaded before (pip's cache is left alone above)
export HF_HUB_OFFLINE=1 XDG_CACHE_HOME="$OUT/cache" TORCHINDUCTOR_CACHE_DIR="$OUT/cache/inductor" \
    TRITON_CACHE_DIR="$OUT/cache/triton" MPLCONFIGDIR="$OUT/cache/matplotlib"
echo "running ruff check . && python -m pytest (log: $OUT/tests.log)"
set +e
{ ruff check . && python -m pytest; } 2>&1 | tee "$OUT/tests.log"
status=${PIPESTATUS[0]}
set -e
finished=$(date +%s)

version() { pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "commit: $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null ||
                    echo ' with uncommitted changes')"
    echo "machine: $(grep -m 1 '^machine: ' "$OUT/tests.log" | sed 's/^machine: //'); load at start $load"
    echo "python: $(python -c 'import platform; print(platform.python_version())')"
    echo "versions: torch $(python -c 'import torch; print(torch.__version__)'), triton $(version triton)," \
         "transformers $(version transformers), trl $(version trl), peft $(version peft)," \
         "bitsandbytes $(version bitsandbytes), accelerate $(version accelerate), kernels $(version kernels)," \
         "datasets $(version datasets), huggingface_hub $(version huggingface_hub)"
    echo "ruff: $(grep -q '^All checks passed!' "$OUT/tests.log" && echo passed || echo failed)"
    echo "pytest: $(grep -E '^=+ .*(passed|failed|error|no tests ran).* in [0-9.]+s' "$OUT/tests.log" | tail -n 1 |
                    sed -E 's/^=+ //; s/ =+$//')"
    echo "duration: installs $((installed - started)) s, ruff and tests $((finished - installed)) s"
    echo "status: $([ "$status" -eq 0 ] && echo passed || echo "failed (exit status $status)")"
} > "$OUT/result.txt"
echo
cat "$OUT/result.txt"
if [ "$refresh" -eq 1 ]; then
    if [ "$status" -eq 0 ]; then write_lock "$OUT"; else echo "the run failed: $LOCK left as it was" >&2; fi
fi
exit "$status"
