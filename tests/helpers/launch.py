"""Launch a script on N ranks as ``torchrun --standalone`` does, paying its imports once.

A torchrun launch is a launcher process plus one fresh interpreter per rank, and on CPU a tiny
training run spends most of its time there importing torch, Megatron-Core and the script's
framework, not training: measured on two cores, 74 to 97% of a launch's CPU time.
:func:`launch` runs the same script instead in ranks forked from a long-lived
*zygote*: a Python process that has imported the ``preload`` modules once, is kept for the rest
of the test session, and serves every later launch with the same interpreter, environment and
``preload``. Each rank is a fresh fork that gets torchrun's rank environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a free port, ...), the
launch's working directory, environment and ``sys.argv``, and runs the script as ``__main__``;
the ranks' output goes to one log, as torchrun's does. When a rank fails, the others are
stopped, as torchrun stops them.

    from helpers.launch import Launch, launch, launch_side_by_side

    result = launch("examples/pretrain_gpt.py", 2, ["--micro-batch-size", "2"],
                    preload=["torch", "megatron.core.models.gpt"])
    assert result.returncode == 0, result.output[-4000:]

What a script sees differs from a torchrun launch only in what was imported before it ran
(and in no torchrun agent: ``TORCHELASTIC_USE_AGENT_STORE`` is unset, so rank 0 hosts the
store). ``torchrun=True`` launches with torchrun itself; users launch with torchrun, so at least
one test of each script should. The zygote never starts a process group, and refuses a
``preload`` that leaves threads running (a fork copies only the thread that forks); where the
preload starts CUDA (importing Megatron on a GPU machine), the launches run under torchrun. A
``preload`` entry is a module to import, or ``module:function`` to import and call (e.g. a CPU
mode to switch on before the framework is imported, as the script itself would).

This file is also the zygote's program: ``python launch.py PRELOAD...`` (stdlib imports only
before the preload).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Launch", "Result", "launch", "launch_side_by_side", "slots", "zygote_count"]

#: Variables that differ between launches but not in what they import (a script reads them
#: when it runs): not part of a zygote's key (its environment is that of the launch that
#: started it; each rank gets its own launch's). ``LOSSFIX_RL_PLAN``: the RL replay's plan
#: (``megatron_lossfix.integrations.megatron_lm.rl_replay``).
_PER_TEST_ENV = ("PYTEST_CURRENT_TEST", "LOSSFIX_RL_PLAN")
#: The fd number on which a zygote writes its replies (its stdout is the imports' output).
_REPLY_FD_ENV = "LAUNCH_ZYGOTE_REPLY_FD"
#: Threads a preload may leave running: jemalloc's background thread (pyarrow's allocator,
#: imported by Megatron Bridge) is restarted in a forked child by jemalloc's own fork handlers.
_FORK_SAFE_THREADS = ("jemalloc_bg_thd",)


@dataclass(kw_only=True)
class Launch:
    """One launch of ``script`` on ``nproc`` ranks (see the module docstring)."""

    script: str | os.PathLike
    args: Sequence[str] = ()
    nproc: int = 1
    cwd: str | os.PathLike | None = None
    #: ``script`` names a module, run as ``python -m`` runs it (``sys.path[0]`` is ``cwd``).
    module: bool = False
    #: The ranks' whole environment (default: this process's).
    env: Mapping[str, str] | None = None
    #: What the zygote imports once (``module`` or ``module:function``); with none, and with
    #: ``torchrun``, the launch is a plain ``torchrun --standalone``.
    preload: Sequence[str] = ()
    torchrun: bool = False


@dataclass
class Result:
    """How a launch ended: its exit status (0, or the first failed rank's) and its output."""

    returncode: int
    output: str
    #: CPU seconds (user + system) of its processes; None for torchrun launches.
    cpu_s: float | None = field(default=None, repr=False)


def launch(
    script: str | os.PathLike,
    nproc: int = 1,
    args: Sequence[str] = (),
    *,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    preload: Sequence[str] = (),
    module: bool = False,
    torchrun: bool = False,
    timeout: float = 900,
) -> Result:
    """Run ``script ARGS`` on ``nproc`` ranks; see :class:`Launch`."""
    job = Launch(script=script, args=args, nproc=nproc, cwd=cwd, env=env, preload=preload,
                 module=module, torchrun=torchrun)  # fmt: skip
    return launch_side_by_side([job], timeout=timeout)[0]


def launch_side_by_side(launches: Sequence[Launch], *, timeout: float = 900) -> list[Result]:
    """Run ``launches`` in order, each started as soon as its ranks get the cores' slots
    (:func:`slots`) beside the running ones; their results in order. A launch past ``timeout``
    seconds raises TimeoutError.

    Two one-rank launches on two cores, or a one-rank launch beside a two-rank one, take little
    longer than one of them alone."""
    import tempfile
    import time

    results: list[Result | None] = [None] * len(launches)
    pending = list(range(len(launches)))
    running: dict[int, tuple[_Running, float]] = {}
    held = _SLOTS.open()
    try:
        while pending or running:
            if pending and held.take(pending[0], launches[pending[0]].nproc):
                i = pending.pop(0)
                running[i] = (_start(launches[i], tempfile.mkdtemp(prefix="launch-")), time.time())
                continue
            for i, (job, started) in list(running.items()):
                if job.poll() is None:
                    if time.time() - started > timeout:
                        raise TimeoutError(f"{launches[i].script} ran past {timeout} s")
                    continue
                del running[i]
                held.give(i)
                results[i] = job.result()
            time.sleep(0.05)
    finally:
        for i, (job, _) in running.items():
            job.kill()
            held.give(i)
        held.give(None)  # the gate, if this call was waiting
    return results  # type: ignore[return-value]


@contextlib.contextmanager
def slots(nproc: int) -> Iterator[None]:
    """Hold the slots of ``nproc`` processes while the block runs (waiting for them first): for
    a test that starts ranks other than through :func:`launch` (a page's ``torchrun`` command).

    The machine has two slots per core, shared by every process of this test run
    (pytest-xdist's workers: lock files named by its run id); a launch of ``n`` ranks holds
    ``min(n, slots)``. Two workers' launches then share the cores up to two ranks a core, and
    a launch of more ranks than that runs alone: an 8-rank gloo job, whose every collective
    waits for its slowest rank, ran 5 times slower beside another worker's launches. (The
    tests' rank pool holds two per run, whatever its world size: holding them all made the
    oracle's 8-rank runs, seconds each, wait out whole launches.)"""
    import time

    held, key = _SLOTS.open(), object()  # a key of its own: such blocks may nest
    try:
        while not held.take(key, nproc):
            time.sleep(0.05)
        yield
    finally:
        held.give(key)


class _Slots:
    """This process's side of the machine's slots (:func:`slots`): one lock file each, and a
    gate: a taker that found too few free holds it while it waits, and no other process takes
    slots meanwhile (a launch of all the slots is not starved by a stream of short runs)."""

    def __init__(self) -> None:
        self.files: list[Any] = []
        self.gate: Any = None
        self.held: dict[object, list[int]] = {}

    def open(self) -> _Slots:
        if not self.files:
            import tempfile

            run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
            folder = Path(tempfile.gettempdir()) / f"launch-slots-{run}"
            folder.mkdir(exist_ok=True)
            count = 2 * (os.cpu_count() or 1)
            self.files = [open(folder / str(k), "a") for k in range(count)]  # noqa: SIM115
            self.gate = open(folder / "gate", "a")  # noqa: SIM115
        return self

    def take(self, key: object, nproc: int) -> bool:
        """Take ``min(nproc, slots)`` free slots for ``key``, all or none; False when too few
        are free now."""
        import fcntl

        try:  # our own gate, or nobody's: go on; another process waits: wait behind it
            fcntl.flock(self.gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        mine = {k for taken in self.held.values() for k in taken}
        # (Beside this process's own slots, only what remains: a nested block cannot wait on
        # slots its outer block holds.)
        want, got = min(nproc, len(self.files) - len(mine)), []
        for k, f in enumerate(self.files):
            if len(got) == want:
                break
            if k in mine:
                continue
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got.append(k)
            except BlockingIOError:
                pass
        if len(got) < want:  # keep the gate
            for k in got:
                fcntl.flock(self.files[k], fcntl.LOCK_UN)
            return False
        fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.held[key] = got
        return True

    def give(self, key: object) -> None:
        """Free ``key``'s slots, and the gate (a waiter takes it again at its next try)."""
        import fcntl

        for k in self.held.pop(key, []):
            fcntl.flock(self.files[k], fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_UN)


_SLOTS = _Slots()


def zygote_count() -> int:
    """How many zygotes this process has started (each paid its ``preload`` once)."""
    return sum(zygote is not None for zygote in _ZYGOTES.values())


# ------------------------------------------------------------------------- the calling side
class _Running:
    """A started launch: ``poll()`` is its exit status once it ended, else None."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.returncode: int | None = None
        self.cpu_s: float | None = None

    def poll(self) -> int | None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def result(self) -> Result:
        output = self.log.read_text(errors="replace")
        self.log.unlink()
        self.log.parent.rmdir()
        return Result(self.returncode, output, self.cpu_s)


class _Torchrun(_Running):
    def __init__(self, job: Launch, log: Path) -> None:
        import subprocess

        super().__init__(log)
        target = ["-m", str(job.script)] if job.module else [str(job.script)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(job.nproc), *target, *job.args]  # fmt: skip
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=job.cwd, env=None if job.env is None else dict(job.env), stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def poll(self) -> int | None:
        self.returncode = self.proc.poll()
        return self.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class _Forked(_Running):
    def __init__(self, zygote: _Zygote, job_id: int, log: Path) -> None:
        super().__init__(log)
        self.zygote, self.job_id = zygote, job_id

    def poll(self) -> int | None:
        done = self.zygote.pump().pop(self.job_id, None)
        if done is not None:
            self.returncode, self.cpu_s = done["returncode"], done["cpu_s"]
        return self.returncode

    def kill(self) -> None:
        self.zygote.kill(self.job_id)


def _start(job: Launch, tmp: str) -> _Running:
    log = Path(tmp) / "output.log"
    if job.torchrun or not job.preload:
        return _Torchrun(job, log)
    env = dict(os.environ if job.env is None else job.env)
    cwd = os.path.abspath(job.cwd if job.cwd is not None else os.getcwd())
    first_on_path = cwd if job.module else os.path.dirname(os.path.abspath(job.script))
    zygote = _zygote(env, first_on_path, tuple(job.preload))
    if zygote is None:  # the preload starts CUDA (a GPU machine): fresh processes, as torchrun
        return _Torchrun(job, log)
    return zygote.start(job, env, log)


class _CudaCannotFork(RuntimeError):
    """The preload started CUDA's driver, whose threads and context a fork cannot copy."""


_ZYGOTES: dict[tuple, _Zygote | None] = {}


def _zygote(env: dict[str, str], folder: str, preload: tuple[str, ...]) -> _Zygote | None:
    """The zygote of scripts in ``folder`` (their ``sys.path[0]``) with this environment and
    ``preload``; started on first use. None where the preload starts CUDA (remembered)."""
    shared = {k: v for k, v in env.items() if k not in _PER_TEST_ENV}
    key = (sys.executable, tuple(sorted(shared.items())), folder, preload)
    known = _ZYGOTES.get(key, False)
    if known is None:
        return None
    if known is False or not known.alive():
        try:
            _ZYGOTES[key] = _Zygote(shared, folder, preload)
        except _CudaCannotFork:
            _ZYGOTES[key] = None
    return _ZYGOTES[key]


class _Zygote:
    """The calling side of one zygote: JSON lines to its stdin, replies from a pipe."""

    def __init__(self, env: dict[str, str], folder: str, preload: tuple[str, ...]) -> None:
        import atexit
        import subprocess
        import tempfile

        for entry in env.get("PYTHONPATH", "").split(os.pathsep):
            if entry and not os.path.isabs(entry):
                raise ValueError(f"PYTHONPATH entry {entry!r} is relative: make it absolute")
        read_fd, write_fd = os.pipe()
        self.output = tempfile.NamedTemporaryFile("w+", prefix="zygote-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, folder, *preload], env={**env, _REPLY_FD_ENV: str(write_fd)},
            stdin=subprocess.PIPE, stdout=self.output, stderr=subprocess.STDOUT,
            pass_fds=(write_fd,), text=True,
        )  # fmt: skip
        os.close(write_fd)
        self.replies, self.pending = read_fd, b""
        ready = self._read()  # blocks until the preload is imported
        if "error" in ready:
            self.close()
            error = _CudaCannotFork if ready.get("cuda") else RuntimeError
            raise error(f"zygote for {list(preload)}: {ready['error']}")
        self.done: dict[int, dict] = {}
        self.next_id = 0
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> dict:
        """The next reply, waiting for it (unbuffered: ``pump`` asks the fd what arrived)."""
        while b"\n" not in self.pending:
            chunk = os.read(self.replies, 1 << 16)
            if not chunk:
                self.output.seek(0)
                raise RuntimeError(f"the zygote exited:\n{self.output.read()[-4000:]}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def start(self, job: Launch, env: dict[str, str], log: Path) -> _Forked:
        self.next_id += 1
        cwd = os.path.abspath(job.cwd if job.cwd is not None else os.getcwd())
        script = str(job.script) if job.module else os.path.abspath(job.script)
        self._send({"id": self.next_id, "script": script, "module": job.module,
                    "args": [str(a) for a in job.args], "nproc": job.nproc, "cwd": cwd,
                    "env": env, "log": str(log)})  # fmt: skip
        return _Forked(self, self.next_id, log)

    def pump(self) -> dict[int, dict]:
        """Read the replies that arrived; the finished launches not collected yet, by id."""
        import select

        while b"\n" in self.pending or select.select([self.replies], [], [], 0)[0]:
            reply = self._read()
            self.done[reply["id"]] = reply
        return self.done

    def kill(self, job_id: int) -> None:
        if self.alive():
            self._send({"kill": job_id})

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()  # the zygote stops its ranks and exits
            try:
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
        if self.replies >= 0:
            os.close(self.replies)
            self.replies = -1
        self.output.close()


# ------------------------------------------------------------------------------ the zygote
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun --standalone sets for a rank on one node (no agent store)."""
    ranks = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank,
             "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_WORLD_SIZE": 1,
             "ROLE_WORLD_SIZE": nproc, "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
             "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
    out = {k: v for k, v in env.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
    out.update({k: str(v) for k, v in ranks.items()})
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def _run_rank(request: dict, rank: int, port: int) -> None:
    """In a forked child: become rank ``rank`` of the launch and run its script; never returns."""
    import atexit
    import runpy
    import threading

    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(_rank_env(request["env"], rank, request["nproc"], port))
        os.chdir(request["cwd"])
        script = request["script"]
        sys.argv = [script, *request["args"]]
        if "torch" in sys.modules:  # a fresh process's generator and thread count
            torch = sys.modules["torch"]
            torch.manual_seed(torch.initial_seed())
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        try:
            if request["module"]:
                runpy.run_module(script, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        # As the interpreter does at exit: wait for threads, run the exit handlers.
        getattr(threading, "_shutdown", lambda: None)()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _serve(folder: str, preload: Sequence[str]) -> None:
    """The zygote of scripts in ``folder``: import ``preload``, then fork ranks for each
    request read from stdin."""
    import gc
    import importlib
    import select
    import signal

    replies = os.fdopen(int(os.environ.pop(_REPLY_FD_ENV)), "w", buffering=1)

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")

    sys.path[0] = folder  # as for `python SCRIPT`: its folder, not this file's
    try:
        for entry in preload:
            module, _, function = entry.partition(":")
            imported = importlib.import_module(module)
            if function:
                getattr(imported, function)()
        others = [task for task in os.listdir("/proc/self/task") if int(task) != os.getpid()]
        threads = [open(f"/proc/self/task/{task}/comm").read().strip() for task in others]
        threads = [name for name in threads if name not in _FORK_SAFE_THREADS]
        torch = sys.modules.get("torch")
        if any(name.startswith("cuda") for name in threads) or (
            torch is not None and torch.cuda.is_initialized()
        ):
            reply({"error": f"importing it started CUDA ({threads}): cannot fork", "cuda": True})
            return
        if threads:
            raise RuntimeError(f"importing it left threads running ({threads}): cannot fork")
    except BaseException as err:  # the caller raises it
        reply({"error": f"{type(err).__name__}: {err}"})
        return
    # Out of the collector's way, in the zygote and every rank it forks: a full collection
    # would otherwise scan all the preloaded objects (a quarter of a second each; Megatron-LM's
    # RL loop collects at every iteration), and touching them would copy their pages.
    gc.freeze()
    reply({"ready": True})
    jobs: dict[int, dict] = {}  # id -> {"pids": {pid: rank}, "codes": {rank: code}, "cpu_s"}
    pids: dict[int, int] = {}  # pid -> id
    buffer = b""
    while True:
        if select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the caller closed: stop everything
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                request = json.loads(line)
                if "kill" in request:
                    for pid, job_id in pids.items():
                        if job_id == request["kill"]:
                            os.kill(pid, signal.SIGKILL)
                    continue
                port = _free_port()
                job = jobs[request["id"]] = {"pids": {}, "codes": {}, "cpu_s": 0.0, "failed": 0}
                sys.stdout.flush()
                sys.stderr.flush()
                for rank in range(request["nproc"]):
                    pid = os.fork()
                    if pid == 0:
                        replies.close()
                        _run_rank(request, rank, port)
                    job["pids"][pid] = rank
                    pids[pid] = request["id"]
        while pids:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            job = jobs[pids.pop(pid)]
            code = os.waitstatus_to_exitcode(status)
            job["codes"][job["pids"][pid]] = code
            job["cpu_s"] += usage.ru_utime + usage.ru_stime
            if code != 0 and not job["failed"]:  # as torchrun: a failed rank stops the others
                job["failed"] = code
                for other in job["pids"]:
                    if other in pids:
                        os.kill(other, signal.SIGTERM)
            if len(job["codes"]) == len(job["pids"]):
                job_id = next(i for i, j in jobs.items() if j is job)
                reply({"id": job_id, "returncode": job["failed"], "cpu_s": job["cpu_s"]})
                del jobs[job_id]


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
