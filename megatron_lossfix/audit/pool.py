"""A pool of long-lived worker processes that run distributed (gloo) functions under many layouts.

Starting a process and importing torch + Megatron-Core costs seconds per rank, and a test suite
wants dozens of parallel layouts. `DistPool` starts `max_ranks` workers once; each `run` gives
ranks `0..world_size-1` a fresh default process group of exactly `world_size` ranks (new store,
short timeout so that a hang fails fast), runs a function there, and tears the process group and
Megatron's parallel state down again. Ranks `>= world_size` sit idle for that call.

With `cuda=True` (a machine with GPUs) the workers keep Megatron on CUDA instead of bridging it
to the CPU: rank r uses GPU r, over NCCL. A world needs a GPU per rank: NCCL refuses two ranks
on one GPU, and gloo refuses CUDA tensors in the coalesced all-reduce Megatron uses.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import queue
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from megatron_lossfix.harness.cpu_megatron import enable_cpu_megatron

# Seconds a worker may take to start (imports on a loaded machine), and extra seconds granted after
# the first rank failed for the others to hit their collective timeout and report.
_STARTUP_TIMEOUT_S = 600.0
_GRACE_S = 30.0


#: What a Megatron-Core rank imports: the fork server imports it once before it forks workers
#: (see DistPool.__init__).
PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron_lossfix.harness.cpu_megatron",
)


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; attached as `__cause__` of a re-raised error."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DistPoolError(RuntimeError):
    """A worker died or stopped answering; the pool was shut down and restarts on next use."""


def _use_loopback() -> None:
    # Gloo binds to the address the hostname resolves to, which in containers may be unreachable;
    # all ranks are local, so loopback always works.
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return
    ifname = next((n for n in ("lo", "lo0") if n in names), None)
    if ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)


def _reset_megatron_state() -> None:
    """Drop process-global Megatron state that refers to the process groups just destroyed."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    parallel_state.destroy_model_parallel()
    get_moe_layer_wise_logging_tracker().clear()
    # Megatron's MTP loss tracker is sized by the first MTP model's layer count: a later model
    # with more MTP layers would index past it.
    MTPLossLoggingHelper.tracker = {}


def _error_report(exc: BaseException) -> tuple[bytes, str, float]:
    """(pickled exception, formatted traceback, when) -- holding no reference to any frame.

    A live traceback would keep the failed collective's work object, and through it this rank's
    gloo sockets, alive; peers blocked on us would then wait for the full timeout instead of
    seeing the connection close.
    """
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return blob, tb, time.time()


def _thread_count() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux
        return None


def _release_stale_graphs() -> None:
    """Free the autograd graphs that outlived their task, and with them the models and groups.

    A tensor that still has a graph after its task finished keeps the graph's nodes alive. Those
    reach the parameters' gradient accumulators, whose DDP hooks reach the model: when the
    model itself holds such a tensor -- Megatron's MoE token dispatchers keep the last forward's
    routing probabilities (`local_probs`) -- the cycle runs through C++ autograd nodes that
    Python's collector cannot see into. The model then outlives its task, and with it every
    process group it names, each with its gloo threads: workers that ran a few hundred MoE tasks
    held thousands of threads, and the kernel time spent on them slowed the suite several-fold.
    Detaching every such tensor in place cuts the cycle; views (which cannot be detached in place)
    are dropped from the module attributes that hold them.
    """
    import torch

    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
            try:
                obj.detach_()
            except RuntimeError:  # a view
                pass
        elif isinstance(obj, torch.nn.Module):
            # The module and the plain helper objects it owns (dispatchers are not modules).
            holders = [obj] + [
                v
                for v in vars(obj).values()
                if hasattr(v, "__dict__")
                and not isinstance(v, (torch.nn.Module, torch.Tensor, type))
            ]
            for holder in holders:
                for name, value in list(vars(holder).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        holder.__dict__[name] = None
    gc.collect()


def _teardown(threads_before: int | None) -> None:
    import torch.distributed as dist

    gc.collect()  # free cycles that still reference process groups before destroying them
    try:
        _reset_megatron_state()
    finally:
        if dist.is_initialized():
            # Closing our sockets also unblocks peers still waiting on us after a failure.
            dist.destroy_process_group()
    # New threads that outlive the task mean process groups that did (see above). Checking
    # first keeps the full object scan off the common path.
    threads = _thread_count()
    if threads is None or threads_before is None or threads > threads_before:
        _release_stale_graphs()


def _fresh_group_names() -> None:
    """Number this task's process groups from 0 on every rank.

    torch names the default group after a per-process counter that only destroying a group
    resets. An `init_process_group` that failed on one rank (a peer gone mid-handshake) leaves
    that rank's counter one ahead: its every later group then waits under a store prefix no
    peer writes, and each task of that worker times out.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


def _wait_for_peers(store: Any, slot: int, world_size: int) -> None:
    """Return once every rank has its process group.

    torch no longer waits after `init_process_group`: a rank whose task needs no collective
    could finish and close its sockets while a peer is still completing gloo's handshake with
    it, failing that peer ("Connection closed by peer").
    """
    store.set(f"lossfix-ready-{slot}", "1")
    store.wait([f"lossfix-ready-{r}" for r in range(world_size)])


def _backend(world_size: int, cuda: bool) -> str:
    import torch

    if not cuda:
        return "gloo"
    if world_size > torch.cuda.device_count():
        raise ValueError(
            f"{world_size} CUDA ranks need {world_size} GPUs, this machine has "
            f"{torch.cuda.device_count()}"
        )
    return "nccl"


def _to_cpu(value: Any) -> Any:
    """Tensors in (nested) dicts, lists and tuples moved to the CPU: results of CUDA workers
    then unpickle in a parent that never touches the GPU."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _run_task(slot: int, task: tuple, timeout_s: float, cuda: bool) -> bytes:
    from datetime import timedelta

    import torch.distributed as dist

    world_size, store_path, payload = task
    threads_before = _thread_count()
    _fresh_group_names()
    try:
        fn, args, kwargs = pickle.loads(payload)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            _backend(world_size, cuda),
            store=store,
            rank=slot,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        _wait_for_peers(store, slot, world_size)
        del store
        result = fn(*args, **kwargs)
        out: tuple = ("ok", _to_cpu(result) if cuda else result)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        out = ("err", *_error_report(exc))
    finally:
        _teardown(threads_before)
    try:
        return pickle.dumps(out)
    except Exception as exc:  # the result itself did not pickle
        return pickle.dumps(("err", *_error_report(exc)))


#: Megatron-Core's logger that says "GPTModel IS DEPRECATED" (0.19) for every GPTModel built.
GPT_MODEL_LOGGER = "megatron.core.models.gpt.gpt_model"


def _not_gpt_deprecation(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("GPTModel IS DEPRECATED")


def quiet_gpt_model_deprecation() -> None:
    """Drop Megatron-Core's "GPTModel IS DEPRECATED" notice in this process: the pool's ranks
    build the audit's own tiny GPT for every layout and reference (a stack audit printed it 12
    times), a model the user did not choose. Idempotent."""
    logger = logging.getLogger(GPT_MODEL_LOGGER)
    if _not_gpt_deprecation not in logger.filters:
        logger.addFilter(_not_gpt_deprecation)


def _worker_main(slot: int, tasks: Any, results: Any, timeout_s: float, cuda: bool) -> None:
    _use_loopback()
    import warnings

    import torch

    # Up to 8 ranks share a few cores: intra-op threads would only contend.
    torch.set_num_threads(1)
    # Known, harmless on CPU: TE/Apex absent, TransformerConfig's own cuda_graph_scope default,
    # and torch's renaming of the collectives Megatron calls.
    for message in (
        ".*(Apex|Transformer Engine).*not installed",
        "full scope is deprecated",
        ".*is deprecated. Please use `torch.distributed",
    ):
        warnings.filterwarnings("ignore", message=message)
    quiet_gpt_model_deprecation()
    # The heavy imports, once per worker rather than in every task (no-ops after the preload).
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    if cuda:
        # Ranks beyond the GPU count idle here; `_backend` refuses worlds that would use them.
        torch.cuda.set_device(slot % torch.cuda.device_count())
    else:
        # A CPU/gloo harness also on a machine with a GPU: results must not depend on which ran
        # them.
        enable_cpu_megatron(force=True)
    # What the imports built lives as long as the worker: out of the collector's way, each
    # task's `gc.collect()` (and Python's own full collections) scans only what tasks made,
    # not the ~450,000 objects of torch and Megatron (0.25 s a collection, every task, every
    # rank).
    gc.freeze()
    results.put(("ready", slot, None))
    while True:
        task = tasks.get()
        if task is None:
            return
        call_id, body = task
        results.put((call_id, slot, _run_task(slot, body, timeout_s, cuda)))


class DistPool:
    """`max_ranks` long-lived worker processes, CPU/gloo unless `cuda`; see the module
    docstring."""

    def __init__(
        self,
        max_ranks: int,
        timeout_s: float = 120,
        start_method: str | None = None,
        cuda: bool = False,
    ):
        if max_ranks < 1:
            raise ValueError(f"max_ranks must be >= 1, got {max_ranks}")
        self.max_ranks = max_ranks
        self.cuda = cuda
        self.timeout_s = float(timeout_s)
        if start_method is None:
            forkserver = "forkserver" in mp.get_all_start_methods()
            # CUDA workers spawn: importing Megatron initializes CUDA in the fork server, and a
            # forked child cannot initialize it again.
            start_method = "forkserver" if forkserver and not cuda else "spawn"
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # The fork server imports torch + Megatron once and forks every worker from that:
            # 8 ranks start in seconds instead of importing 8 times (~30-50 s on 2 cores). It
            # is a fresh process that never touched CUDA or a process group, so forking it is
            # as safe as spawning. (Ignored if this process's fork server is already running.)
            self._ctx.set_forkserver_preload(list(PRELOAD))
        self._procs: list = []
        self._tasks: list = []
        self._results: Any = None
        self._tmpdir: str | None = None
        self._calls = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers (done lazily by `run`); blocks until all have imported Megatron."""
        if self._procs:
            return
        self._tmpdir = tempfile.mkdtemp(prefix="distpool-")
        self._results = self._ctx.Queue()
        for slot in range(self.max_ranks):
            tasks = self._ctx.Queue()
            proc = self._ctx.Process(
                target=_worker_main,
                args=(slot, tasks, self._results, self.timeout_s, self.cuda),
                name=f"distpool-rank{slot}",
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
            self._tasks.append(tasks)
        pending = set(range(self.max_ranks))
        while pending:
            kind, slot, _ = self._get(_STARTUP_TIMEOUT_S, "starting")
            if kind == "ready":
                pending.discard(slot)

    def close(self) -> None:
        """Stop the workers. The pool can be started again by a later `run`."""
        for tasks, proc in zip(self._tasks, self._procs, strict=True):
            if proc.is_alive():
                try:
                    tasks.put(None)
                except (OSError, ValueError):
                    pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._tasks, self._results = [], [], None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running -----------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list:
        """Run `fn(*args, **kwargs)` on ranks `0..world_size-1` of a fresh process group.

        `fn` must be a picklable top-level function. Returns the per-rank results (index = rank).
        If a rank raises, the exception is re-raised here, its remote traceback as `__cause__`.
        """
        if not 1 <= world_size <= self.max_ranks:
            raise ValueError(f"world_size must be in 1..{self.max_ranks}, got {world_size}")
        payload = pickle.dumps((fn, args, kwargs))  # fail here, not in every worker
        self.start()
        self._calls += 1
        call_id = self._calls
        store_path = os.path.join(self._tmpdir, f"store-{call_id}")
        for rank in range(world_size):
            self._tasks[rank].put((call_id, (world_size, store_path, payload)))

        outs: dict[int, tuple] = {}
        failing = False
        while len(outs) < world_size:
            # Healthy ranks may compute for as long as they need; once one has failed the others
            # only have to reach their collective timeout and report.
            wait = self.timeout_s + _GRACE_S if failing else None
            got_id, slot, blob = self._get(wait, f"running {getattr(fn, '__name__', fn)}")
            if got_id != call_id:
                continue  # a straggler from an earlier call that was given up on
            outs[slot] = pickle.loads(blob)
            failing = failing or outs[slot][0] == "err"
        if os.path.exists(store_path):
            os.remove(store_path)
        failed = sorted(r for r, o in outs.items() if o[0] == "err")
        if failed:
            # The rank that failed first is the cause; the others mostly report its absence.
            root = min(failed, key=lambda r: outs[r][3])
            _, blob, tb, _ = outs[root]
            try:
                exc = pickle.loads(blob)
            except Exception:  # its class may not be importable here
                exc = RuntimeError(tb.strip().splitlines()[-1])
            exc.__cause__ = RemoteTraceback(
                f"\n--- rank {root} of {world_size} (first to fail; failed: {failed}) ---\n{tb}"
            )
            raise exc
        return [outs[r][1] for r in range(world_size)]

    def _get(self, timeout: float | None, what: str) -> tuple:
        """Next message from the workers, polling so that a dead worker is noticed."""
        waited = 0.0
        while True:
            try:
                return self._results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
            dead = [p.name for p in self._procs if not p.is_alive()]
            if dead or (timeout is not None and waited >= timeout):
                self.close()
                reason = f"workers died: {dead}" if dead else f"no answer after {timeout:.0f} s"
                raise DistPoolError(f"DistPool {what}: {reason}; pool shut down") from None
