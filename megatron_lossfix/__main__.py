"""``python -m megatron_lossfix <command>`` (also the ``megatron-lossfix`` console script).

Commands (in the order ``--help`` lists them):
  audit    run the gradient invariance matrix on this machine (``megatron_lossfix.audit``)
  install-bridge  install Megatron Bridge into this environment (``integrations.bridge.install``)
  install-nemo-rl  install NeMo-RL from its sources (``integrations.nemo_rl.install``)
  patches  apply, check, revert or list our Megatron-LM patches (``integrations.megatron_lm``)
  rl-replay  replay fixed rollouts through Megatron-LM's train_rl.py; ``compare``: stock against
           the plugin, 1 rank against DP2 (``integrations.megatron_lm.rl_replay``)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

# name -> (one-line help, module whose ``main(argv) -> int`` runs it), in the order of the
# choices; imported on use only, so that ``--help`` does not pay for torch and Megatron.
COMMANDS: dict[str, tuple[str, str]] = {
    "audit": (
        "check every reduction mode's gradient against a one-rank reference over parallel "
        "layouts; writes audit.json (and audit.png with matplotlib), exits 1 on a miss",
        "megatron_lossfix.audit.command",
    ),
    "install-bridge": (
        "install Megatron Bridge 0.6.2 into this Python's environment (3.12, megatron-core "
        "0.19; CPU or CUDA); refuses another Python or megatron-core in one line",
        "megatron_lossfix.integrations.bridge.install",
    ),
    "install-nemo-rl": (
        "install NeMo-RL, its Megatron Bridge and Megatron-LM's megatron/core from their "
        "sources (clones or git archives) into this Python's environment (docs/nemo_rl.md)",
        "megatron_lossfix.integrations.nemo_rl.install",
    ),
    "patches": (
        "apply, check or revert the Megatron-LM patch that adds --loss-reduction and the "
        "plugin's flags to pretrain_gpt.py and train_rl.py, or list the patches",
        "megatron_lossfix.integrations.megatron_lm.patches",
    ),
    "rl-replay": (
        "replay fixed rollouts through a patched Megatron-LM's train_rl.py (CPU or GPU): "
        "write-plan, compare (stock against the plugin, 1 rank against DP2), or a rank",
        "megatron_lossfix.integrations.megatron_lm.rl_replay",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m megatron_lossfix",
        description="megatron_lossfix tools. Run `<command> --help` for a command's flags.",
    )
    parser.add_argument(
        "command",
        choices=list(COMMANDS),
        help="; ".join(f"{k}: {v[0]}" for k, v in COMMANDS.items()),
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own flags")
    # Parse only the command name: everything after it belongs to the command.
    ns = parser.parse_args(argv[:1])
    from importlib import import_module

    return int(import_module(COMMANDS[ns.command][1]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
