"""The self-check: the first step's gradient must not move when re-split (docs/design.md §9).

The check runs on top of the step: it calls it (:class:`~megatron_lossfix.step.driver.Step`, or what
runs it, such as Megatron-LM's plumbing around it) re-split and normally, last, after learning
what it reads (read ahead where the step reads all its micro-batches first, else in a
forward-only pass), so that training goes on from the normal run with nothing to put back.
It keeps no copy of a gradient: each run's is summarized by per-parameter sums and a few
seeded random projections (``gradient_sketch``). The step knows nothing of it;
``LossFixSchedule`` composes the two (:func:`first_step_check`): by default in every mode that
can be checked, skipped with one line that says why where the step cannot be checked; when the
config asks for it explicitly (``self_check=True``), such a step is warned about or refused.

One module a concept, in the order the check meets them: ``check`` (:class:`SelfCheck`, whose
``run`` calls the phases in order; whether a step is checked, and the line that says it is
not), ``reads`` (what the step reads, and the runs' replays of it), ``plan`` (which re-split
every rank runs, or why none), ``runs`` (the re-split runs, then the normal run) and ``verdict``
(the replicas' spread, the re-split's distance, the lines that say them); beneath them
``model`` (the model's gradients around the runs), ``microbatch_resplit`` (how a re-split cuts
the micro-batches) and ``gradient_sketch`` (a run's gradient in a few numbers).
"""

from megatron_lossfix.step.selfcheck.check import (
    SelfCheck,
    first_step_check,
    left_out,
    switched_on,
)
from megatron_lossfix.step.selfcheck.verdict import SelfCheckError

__all__ = ["SelfCheck", "SelfCheckError", "first_step_check", "left_out", "switched_on"]
