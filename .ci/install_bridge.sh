#!/usr/bin/env bash
# CI's call into the user-facing installer (noxfile.py builds its Bridge virtualenv with it):
#
#   .ci/install_bridge.sh PATH/TO/VENV/bin/python
#
# is `PATH/TO/VENV/bin/python -m megatron_lossfix install-bridge` with this checkout importable
# (CI's Bridge virtualenv is layered over the suite's by a .pth file: pip sees torch and
# megatron-core there and installs only what is missing, into the upper virtualenv).
set -euo pipefail
PY=${1:?usage: .ci/install_bridge.sh PATH/TO/VENV/bin/python}
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m megatron_lossfix install-bridge
