#!/usr/bin/env bash
# The README's main command on a fresh machine, as a new user runs it: a new virtual environment, the
# `all` extra (not `dev`, which brings test tools a user doesn't have), then `rollway --help`, every
# subcommand's --help, and a short `rollway demo` that does real work: an SFT warm-up, the real arithmetic
# agent through the gateway, at least one RL step trained on those sessions, and one publish.
#
# Twice: editable from the checkout (the README's command), and from a built wheel in a directory outside
# the checkout (so package data missing from the wheel shows).
#
#   .ci/fresh_install.sh [SOURCE_DIR]     # default: this checkout
set -euo pipefail
src=$(cd "${1:-$(dirname "$0")/..}" && pwd)
work=$(mktemp -d /tmp/rollway-fresh.XXXXXX)
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset ROLLWAY_ADMIN_KEY

check() {  # $1: the venv's bin folder, $2: a name for the log lines
  local bin=$1 name=$2 out
  echo "--- [$name] rollway --help and every subcommand's --help"
  "$bin/rollway" --help >/dev/null
  for cmd in serve engine init-model rollout train demo db view; do
    "$bin/rollway" "$cmd" --help >/dev/null || { echo "FAIL: rollway $cmd --help" >&2; return 1; }
  done
  echo "--- [$name] rollway demo (short: 300 SFT steps at most, 1 RL step, 16 held-out tasks)"
  mkdir -p "$work/run-$name"
  # From outside the checkout: the agents and tasks must come from the installed package.
  out=$(cd "$work/run-$name" && "$bin/rollway" demo --out demo --steps 1 --minutes 15 --sft-steps 300 --eval-tasks 16 \
        2> "$work/run-$name/demo.err" | tail -1) || { tail -40 "$work/run-$name/demo.err" >&2; return 1; }
  echo "$out"
  "$bin/python" - "$out" <<'EOF'
import json, sys
summary = json.loads(sys.argv[1])
assert summary["steps"] >= 1, f"no RL step trained: {summary}"
assert summary["weight_version"] >= 1, f"nothing published: {summary}"
print(f"ok: {summary['steps']} step(s), weights published up to version {summary['weight_version']}")
EOF
}

echo "--- [editable] python -m venv; pip install torch==2.13.0 -e '.[all]'"
python -m venv "$work/venv-editable"
"$work/venv-editable/bin/pip" install -q torch==2.13.0 -e "$src[all]"
check "$work/venv-editable/bin" editable

echo "--- [wheel] pip wheel; python -m venv; pip install torch==2.13.0 'rollway-*.whl[all]'"
python -m pip wheel -q --no-deps -w "$work/dist" "$src"
python -m venv "$work/venv-wheel"
wheel=$(ls "$work"/dist/rollway-*.whl)
"$work/venv-wheel/bin/pip" install -q torch==2.13.0 "$wheel[all]"
check "$work/venv-wheel/bin" wheel
echo "--- fresh install: ok"
