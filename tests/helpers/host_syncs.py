"""The one probe for host syncs: the tensor calls that make the host wait for the device on a GPU.

On a CPU machine nothing waits, so the tests cannot time a sync; they record the calls that
would make one instead. :class:`HostSyncs` is a ``TorchFunctionMode``: while active it records
every call of :data:`HOST_SYNCS` with the line of our package that made it, and counts them by
the phase a caller names. ``tests/test_step_microbatch.py`` checks that it sees each name.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode

import megatron_lossfix

#: Calls that make the host wait for the device on a GPU. Reads of a value: ``.item()``,
#: ``.tolist()``, ``.numpy()``, ``__array__`` (``numpy.asarray``), ``bool()``, ``float()``,
#: ``int()``, ``operator.index()``, and ``torch.equal``/``torch.allclose`` (a Python bool).
#: A copy to the host: ``.cpu()``. Tensors built from host data: ``torch.tensor`` and
#: ``torch.as_tensor`` (a copy to the device, which waits for the stream). Results whose size
#: depends on the values: ``nonzero``, ``argwhere``, ``masked_select``, ``unique``,
#: ``unique_consecutive``.
HOST_SYNCS = frozenset(
    ("item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__",
     "equal", "allclose", "cpu", "tensor", "as_tensor", "nonzero", "argwhere", "masked_select",
     "unique", "unique_consecutive")
)  # fmt: skip

_PACKAGE = os.path.dirname(os.path.abspath(megatron_lossfix.__file__)) + os.sep


def _our_line() -> str:
    """``file:line`` of the innermost frame in our package that is on the stack, or ``?``."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostSyncs(TorchFunctionMode):
    """Records, while active, each call of :data:`HOST_SYNCS`: ``calls`` holds
    ``"<name> at <file>:<line>"`` (the line of our package that made it), ``counts`` how many
    were made in each phase, ``phase()`` naming it at the time of the call (``"all"`` without)."""

    def __init__(self, phase: Callable[[], str] | None = None) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.counts: collections.Counter = collections.Counter()
        self._phase = phase

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):  # noqa: ANN204
        name = getattr(func, "__name__", "")
        if name in HOST_SYNCS:
            self.calls.append(f"{name} at {_our_line()}")
            self.counts[self._phase() if self._phase else "all"] += 1
        return func(*args, **(kwargs or {}))

    def names(self) -> list[str]:
        """The names of the calls recorded, in order."""
        return [call.split(" at ")[0] for call in self.calls]
