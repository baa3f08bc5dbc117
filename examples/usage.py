"""One-line usage errors for the example scripts, before distributed start-up.

torchrun starts every rank with the same flags, so a mistake in them is found on every rank at
once: rank 0 says it in one line, ``prog: error: message``, and every rank exits with status 2.
No Megatron import here: ``bridge_pretrain.py`` parses its flags before its CPU bridge is on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NoReturn

import torch.distributed as dist

__all__ = ["ExampleArgumentParser", "UsageError", "exit_before_startup", "print_error"]


class UsageError(Exception):
    """A mistake in the flags or the data, found before start-up: reported as one line."""


def _reporting_rank() -> bool:
    """Whether this process prints errors for the whole launch: global rank 0 (torchrun's
    ``RANK`` before torch.distributed starts), or a process started without torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def print_error(prog: str, message: str) -> None:
    # One write, newline included: torchrun's ranks share the stream and run unbuffered, where
    # print's separate write of the newline lets two ranks' lines interleave.
    print(f"{prog}: error: {message}\n", end="", file=sys.stderr, flush=True)


def exit_before_startup(prog: str, message: str) -> NoReturn:
    """Exit 2 on every rank; rank 0 prints the line. torchrun stops the whole launch as soon as
    one rank exits, so the silent ranks give rank 0 a moment to print before they go."""
    if _reporting_rank():
        print_error(prog, message)
    else:
        time.sleep(_SILENT_RANK_GRACE_S)
    sys.exit(2)


#: How long a silent rank waits before exiting on a usage error (see exit_before_startup).
_SILENT_RANK_GRACE_S = 3.0


class ExampleArgumentParser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line, ``prog: error: message``, printed by
    global rank 0 only (torchrun starts every rank with the same flags), with exit status 2 on
    every rank. The usage text, a screenful for these scripts, is left to ``--help``."""

    def error(self, message: str) -> NoReturn:
        exit_before_startup(self.prog, message)
