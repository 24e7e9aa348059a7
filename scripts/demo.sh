#!/usr/bin/env bash
# Set up (first time) and run the demo: a verifier on the bundled target, an edge with the
# default draft, one generation, the statistics, and the cloud-only baseline for comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hybridspec demo "$@"
