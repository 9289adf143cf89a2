#!/usr/bin/env bash
# Entry point of the local test stack: e2e/stack.sh up|down|status|env|build|node-down|node-up.
# The logic is in e2e/stack/ (standard-library Python only, so it runs before any venv exists).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! command -v python3 >/dev/null 2>&1; then
  echo "stack: python3 is not on PATH (needed to run e2e/stack)" >&2
  exit 2
fi
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m stack "$@"
