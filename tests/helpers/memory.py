"""Live CPU tensor bytes while a function runs, from torch.profiler's allocation records (the
allocator's running total): their peak, and what was live when each ``record_function`` range
named ``MARK`` began, both above the bytes live just before the function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MARK = "tensor-peak-mark"


def tensor_peak(fn: Callable[[], Any]) -> tuple[Any, int, list[int]]:
    """``fn()``, the peak of CPU tensor bytes while it ran, and the bytes live at each ``MARK``
    range's start, both above those live before it."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    allocs, marks, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            allocs.append((event.start_time_ns, event.extra_fields))
        elif event.name == MARK:
            marks.append(event.start_time_ns)
    allocs.sort(key=lambda item: item[0])
    first = allocs[0][1].total_allocated - allocs[0][1].alloc_size if allocs else 0
    peak = max([a.total_allocated for _, a in allocs], default=first) - first
    live = []
    for mark in sorted(marks):
        before = [a.total_allocated for t, a in allocs if t <= mark]
        live.append((before[-1] if before else first) - first)
    return out, peak, live
