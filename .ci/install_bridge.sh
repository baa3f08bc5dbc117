#!/usr/bin/env bash
# Install Megatron Bridge 0.6.2 into an existing Python 3.12 environment that already holds
# torch and megatron-core 0.19.x, on a machine without CUDA. (CI installs it into a virtualenv
# whose .pth file adds the suite's site-packages after its own: pip sees torch and megatron-core
# there and installs only what is missing, into the upper virtualenv.)
#
#   .ci/install_bridge.sh PATH/TO/VENV/bin/python
#
# `pip install megatron-bridge==0.6.2` fails there: its dependency fast-hadamard-transform builds
# from source and needs CUDA (so do flashinfer, transformer-engine and others Bridge lists but the
# GPT training loop never imports). So: Bridge without dependencies, then what `pretrain()`
# imports (bridge-requirements.txt). torch and megatron-core stay as they are (pinned by a constraints file).
# Never `pip install megatron`: an unrelated PyPI project that breaks the `megatron` namespace.
# The installed nvidia-resiliency-ext (0.4.1, the newest on PyPI for this platform) is too old for
# megatron-core's checkpointing probe: megatron_lossfix.integrations.cpu_megatron_bridge.enable_cpu_bridge() hides it,
# so plain `import megatron.core` fails in this environment without that call.
set -euo pipefail
PY=${1:?usage: .ci/install_bridge.sh PATH/TO/VENV/bin/python}
"$PY" -c 'import sys; assert sys.version_info[:2] >= (3, 12), "Bridge 0.6 needs Python >= 3.12"'

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" -m pip freeze | grep -iE '^(torch|megatron[-_]core)==' > "$constraints" || {
    echo "install torch and megatron-core into this environment first" >&2
    exit 1
}

"$PY" -m pip install -q --no-deps megatron-bridge==0.6.2
"$PY" -m pip install -q -c "$constraints" -r "$(dirname "$0")/bridge-requirements.txt"

# Smoke test: Bridge's training entry point imports with the plugin's CPU shims.
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -W ignore -c '
from megatron_lossfix.integrations.cpu_megatron_bridge import enable_cpu_bridge
enable_cpu_bridge()
from megatron.bridge.training.pretrain import pretrain
import megatron.bridge
print("megatron-bridge", megatron.bridge.__version__, "imports")
'
