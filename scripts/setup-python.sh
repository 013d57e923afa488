#!/usr/bin/env bash
# The Python environment of the reports and the tests (reports/requirements.txt) and, with
# --peers, of the framework peers (bench/peers/requirements.txt): a virtual environment of
# Debian's python3, outside the clone so that it is made once per machine, with pinned
# versions from PyPI. Prints the environment's python on its last line.
#
# Usage: scripts/setup-python.sh [--peers]
# Environment: MHA_VENV, the environment's folder (default: ~/.cache/mha/venv)
# Exit status: 0 ready; 77 PyPI could not be reached (a "skipped: why" line says so);
# 1 anything else failed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MHA_VENV:-$HOME/.cache/mha/venv}"
REQS=("$REPO/reports/requirements.txt")
[[ ${1:-} == --peers ]] && REQS+=("$REPO/bench/peers/requirements.txt")

say() { echo "setup-python: $*" >&2; }

if [[ ! -x $VENV/bin/python ]]; then
  say "creating $VENV"
  mkdir -p "$(dirname "$VENV")"
  /usr/bin/python3 -m venv "$VENV" ||
    { say "error: /usr/bin/python3 -m venv failed (Debian: python3-venv)"; exit 1; }
fi

for req in "${REQS[@]}"; do
  stamp="$VENV/.installed-$(basename "$(dirname "$req")")"
  want=$(sha256sum "$req" | cut -d' ' -f1)
  if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
    continue
  fi
  say "installing ${req#"$REPO"/} (pinned versions from PyPI)"
  log=$(mktemp)
  if ! "$VENV/bin/pip" install --disable-pip-version-check -q -r "$req" >"$log" 2>&1; then
    if grep -q -i -E 'connection|resolve|network|timed out|temporary failure' "$log"; then
      say "skipped: PyPI could not be reached ($(grep -m1 -i -E 'connection|resolve|network|timed out|temporary failure' "$log" | cut -c1-120))"
      rm -f "$log"
      exit 77
    fi
    cat "$log" >&2
    rm -f "$log"
    say "error: pip install -r ${req#"$REPO"/} failed"
    exit 1
  fi
  rm -f "$log"
  echo "$want" >"$stamp"
done
echo "$VENV/bin/python"
