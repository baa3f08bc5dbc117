"""Run Megatron-LM's (patched) ``pretrain_gpt.py`` on this machine and read back what it logged.

For the checks in ``tests/test_patches.py`` and for reproducing them by hand:

- :func:`write_padded_dataset` writes a tiny Megatron indexed dataset (``.bin``/``.idx``) whose
  documents end in runs of EOD tokens. With ``--eod-mask-loss`` Megatron-LM's own
  ``GPTDataset`` masks every position whose input is EOD, so loss masks vary strongly between
  sequences and micro-batches, like padded SFT data (the mock dataset has about one EOD per
  2,000 tokens: its masks are all ones at small sequence lengths).
- :func:`tiny_gpt_args` are the flags of a tiny CPU-friendly GPT run.
- :func:`run_pretrain_gpt` launches ``pretrain_gpt.py`` as ``torchrun`` would (its ranks forked
  from a process that imported the tree once: :mod:`helpers.launch`) and parses the log lines
  and, with ``--lossfix-metrics-out``, the JSON metrics; :func:`run_pretrain_gpts` runs several
  side by side where the cores allow.

- :func:`unpack_tag` unpacks a Megatron-LM source archive (``<tag>.tar.gz``, unpacking to
  ``Megatron-LM/``) from the folder named by ``MEGATRON_LM_ARCHIVES``; :func:`tags_to_test` says
  which tags a test session runs (``MEGATRON_LM_TAGS``, else the tag of the installed
  megatron-core's release series).

    cd tests && python -m helpers.megatron_lm_run write-data OUT/padded PATH_TO_MEGATRON_LM
"""

from __future__ import annotations

import json
import os
import re
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from helpers.inputs import MISSING
from helpers.launch import Launch as Job
from helpers.launch import launch_side_by_side
from megatron_lossfix.integrations.megatron_lm import patches
from megatron_lossfix.integrations.megatron_lm.tiny_gpt import (
    VOCAB_SIZE,
    checkout_null_tokenizer_eod,
    tiny_gpt_flags,
)

__all__ = [
    "Launch",
    "RunResult",
    "checkout_null_tokenizer_eod",
    "megatron_lm_env",
    "logged_values",
    "patched_copy",
    "prepare_tree",
    "reuse_installed_helpers",
    "run_pretrain_gpt",
    "run_pretrain_gpts",
    "save_initial_checkpoint",
    "skip_reason",
    "tags_to_test",
    "tiny_gpt_args",
    "unpack_tag",
    "write_padded_dataset",
]

#: Environment variable naming a folder of Megatron-LM source archives, ``<tag>.tar.gz``, each
#: unpacking to ``Megatron-LM/`` (``.ci/run`` sets it).
ARCHIVES_ENV = "MEGATRON_LM_ARCHIVES"
#: Optional: comma-separated tags to test (or ``all``) instead of the installed release's tag.
TAGS_ENV = "MEGATRON_LM_TAGS"
NEEDS_ARCHIVES = (
    f"set {ARCHIVES_ENV} to a folder of Megatron-LM source archives (<tag>.tar.gz, "
    "e.g. core_v0.19.0.tar.gz, each unpacking to Megatron-LM/)"
)


def write_padded_dataset(
    prefix: str | os.PathLike,
    *,
    eod: int,
    num_docs: int = 400,
    seed: int = 0,
    text_len: tuple[int, int] = (4, 48),
    pad_len: tuple[int, int] = (1, 48),
) -> str:
    """Write ``prefix.bin``/``prefix.idx``: documents of random tokens followed by runs of
    ``eod`` (the EOD id of the tokenizer the run uses: :func:`checkout_null_tokenizer_eod`).

    Returns the prefix (what ``--data-path`` takes). Deterministic for a given ``seed``.
    """
    if not 0 <= eod <= VOCAB_SIZE:
        raise ValueError(f"eod={eod} is outside the tokenizer's ids 0..{VOCAB_SIZE}")
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(num_docs):
        # Text ids 0..254: never EOD (256 up to Megatron-LM 0.17, 255 from 0.18).
        text = rng.integers(0, VOCAB_SIZE - 1, size=int(rng.integers(*text_len)))
        pad = np.full(int(rng.integers(*pad_len)), eod)
        builder.add_document(np.concatenate([text, pad]), [len(text) + len(pad)])
    builder.finalize(prefix + ".idx")
    return prefix


def tiny_gpt_args(
    *,
    micro_batch_size: int,
    global_batch_size: int = 8,
    train_iters: int = 3,
    data_path: str | None = None,
    seq_length: int = 64,
    eod: int | None = None,
) -> list[str]:
    """Flags of a tiny GPT that Megatron-LM trains on CPU in seconds per step (local layers,
    no fused kernels, no dropout, so runs are comparable across layouts).

    With ``eod`` (the checkout's NullTokenizer EOD id, :func:`checkout_null_tokenizer_eod`) the
    vocabulary is padded to the same size under TP1 and TP2: Megatron-LM pads it to a multiple
    of ``--make-vocab-size-divisible-by`` x TP, and the padding changes both the initial weights
    and the softmax, so the default (128) gives TP2 another model than TP1.
    """
    args = tiny_gpt_flags(seq_length=seq_length, micro_batch_size=micro_batch_size,
                          global_batch_size=global_batch_size, train_iters=train_iters,
                          lr="1e-3")  # fmt: skip
    if eod is not None:
        args += ["--make-vocab-size-divisible-by", str(-(-(eod + 1) // 2))]  # half the vocabulary
    if data_path is None:
        args.append("--mock-data")
    else:
        args += ["--data-path", data_path, "--split", "100,0,0", "--eod-mask-loss"]
    return args


def save_initial_checkpoint(
    megatron_lm_path: str | os.PathLike, args: Sequence[str], dest: str | os.PathLike
) -> tuple[list[str], RunResult]:
    """Save the initial weights of the one-rank model of ``args`` to ``dest`` (one iteration at
    learning rate 0); returns the flags that make another run start from them, and the run's
    result (what else ``args`` asks of it, an evaluation say, is in its log).

    Megatron-LM seeds each pipeline stage differently (seed + 100 x stage), so a PP2 run would
    otherwise train other initial weights than PP1. Its torch_dist checkpoints reshard on load,
    so every TP/PP/DP layout can load this one. Needs ``psutil`` (the checkpoint writer uses it).
    """
    args = list(args)
    for flag, value in (("--train-iters", "1"), ("--lr", "0")):
        args[args.index(flag) + 1] = value
    if "--min-lr" not in args:
        args += ["--min-lr", "0"]
    args += ["--save", str(dest), "--save-interval", "1"]
    result = run_pretrain_gpt(megatron_lm_path, args, nproc=1)
    if result.returncode != 0:
        raise RuntimeError(f"saving the initial checkpoint failed:\n{result.output[-4000:]}")
    return ["--load", str(dest), "--finetune", "--no-load-optim", "--no-load-rng"], result


def prepare_tree(
    folder: str | os.PathLike, tag: str, dest: str | os.PathLike
) -> tuple[Path, int, str]:
    """Unpack ``tag`` from ``folder`` into ``dest``, patch it and write the masked data there:
    returns the tree, its NullTokenizer EOD id and the data prefix (``--data-path``)."""
    dest = Path(dest)
    tree = unpack_tag(folder, tag, dest)
    patches.apply(tree)
    reuse_installed_helpers(tree)
    eod = checkout_null_tokenizer_eod(tree)
    return tree, eod, write_padded_dataset(dest / "data" / "padded", eod=eod)


def reuse_installed_helpers(megatron_lm_path: str | os.PathLike) -> bool:
    """Put the installed megatron-core's compiled dataset helpers into a Megatron-LM tree whose
    ``helpers.cpp`` is the same file, so that the ``make`` its first run calls has nothing to do
    (compiling them costs about 15 s of CPU per tree); whether it did. A tree with other helpers
    (``main``, another release) keeps compiling its own."""
    import filecmp
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("megatron.core.datasets.helpers_cpp")
    tree = Path(megatron_lm_path) / "megatron" / "core" / "datasets"
    if spec is None or spec.origin is None or not (tree / "helpers.cpp").is_file():
        return False
    installed = Path(spec.origin)
    if not filecmp.cmp(installed.parent / "helpers.cpp", tree / "helpers.cpp", shallow=False):
        return False
    shutil.copyfile(installed, tree / installed.name)  # a new file: newer than helpers.cpp
    return True


def patched_copy(source: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Copy what ``pretrain_gpt.py`` needs from a checkout (its top-level scripts and
    ``megatron/``) to ``dest`` and apply our patch there (a no-op if the source was patched).

    The runs compile Megatron's dataset helpers into the tree they run from: a copy keeps the
    checkout as it was.
    """
    import shutil

    source, dest = Path(source), Path(dest)
    dest.mkdir(parents=True)
    for script in source.glob("*.py"):
        shutil.copy2(script, dest / script.name)
    shutil.copytree(
        source / "megatron", dest / "megatron", ignore=shutil.ignore_patterns("__pycache__")
    )
    patches.apply(dest)
    return dest


def megatron_lm_env(megatron_lm_path: str | os.PathLike) -> dict[str, str]:
    """Environment for a Megatron-LM run from this interpreter.

    ``megatron_lm_path`` goes first on ``PYTHONPATH`` (its ``megatron`` package, not an
    installed megatron-core). Megatron-LM compiles its dataset helpers on first use with
    ``make``, which calls ``python3`` (needs pybind11) and ``python3-config``: put this
    interpreter and its base installation first on ``PATH`` so both match it.
    """
    env = dict(os.environ)
    bins = [os.path.dirname(sys.executable), os.path.join(sys.base_prefix, "bin")]
    env["PATH"] = os.pathsep.join([*bins, env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(megatron_lm_path), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    # Megatron-LM's argument check demands it for tensor parallelism before Blackwell.
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return env


_LOG_LINE = re.compile(
    r"iteration\s+(\d+)/.*?lm loss: ([0-9.eE+-]+) \|.*?grad norm: ([0-9.eE+-]+) \|"
)


def logged_values(output: str, name: str) -> dict[int, str]:
    """Iteration -> the value of ``name`` (e.g. ``load_balancing_loss``) on Megatron-LM's
    training log lines, as printed."""
    pattern = re.compile(rf"iteration\s+(\d+)/.*?\| {re.escape(name)}: ([0-9.eE+-]+) \|")
    return {int(m[1]): m[2] for m in pattern.finditer(output)}


@dataclass
class RunResult:
    """What one ``pretrain_gpt.py`` run logged."""

    returncode: int
    output: str
    logged: list[dict] = field(default_factory=list)
    """Per logged iteration: ``iteration``, ``lm_loss`` and ``grad_norm`` as printed."""
    metrics: list[dict] = field(default_factory=list)
    """The ``--lossfix-metrics-out`` records (full precision), if requested."""


@dataclass(kw_only=True)
class Launch:
    """One launch of a Megatron-LM script (``pretrain_gpt.py`` by default) from its tree, for
    :func:`run_pretrain_gpts`."""

    megatron_lm_path: str | os.PathLike
    args: Sequence[str]
    nproc: int = 1
    metrics_out: str | os.PathLike | None = None
    script: str | os.PathLike = "pretrain_gpt.py"
    """The script to run: a path in the checkout, an absolute path, or (``module``) a module
    that runs one of the checkout's scripts (the package's
    ``integrations.megatron_lm.rl_replay``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to :func:`megatron_lm_env`."""
    #: Launch with torchrun, as users do, rather than forked from the tree's zygote
    #: (:mod:`helpers.launch`): at least one test per script should.
    torchrun: bool = False
    #: What the zygote imports once, from the tree: by default the script's own module when it
    #: lies in the tree; with none (a helper outside it, by default), torchrun launches it.
    preload: Sequence[str] | None = None
    #: ``script`` names a module (run as ``python -m`` runs it, from the tree).
    module: bool = False


def run_pretrain_gpt(
    megatron_lm_path: str | os.PathLike,
    args: Sequence[str],
    *,
    nproc: int = 1,
    metrics_out: str | os.PathLike | None = None,
    timeout: float = 900,
) -> RunResult:
    """``torchrun --standalone --nproc-per-node NPROC PATH/pretrain_gpt.py ARGS``, its ranks
    forked from the tree's zygote (:func:`run_pretrain_gpts`)."""
    launch = Launch(megatron_lm_path=megatron_lm_path, args=args, nproc=nproc,
                    metrics_out=metrics_out)  # fmt: skip
    return run_pretrain_gpts([launch], timeout=timeout)[0]


def run_pretrain_gpts(launches: Sequence[Launch], *, timeout: float = 900) -> list[RunResult]:
    """Run ``launches`` side by side where the cores allow (:func:`launch_side_by_side`); results
    in order. Each rank is forked from a zygote that imported the script's module from its tree
    once (the tree's ``megatron`` package shadows the installed one): the first launch of a
    tree pays those imports, the others do not."""
    jobs = []
    for launch in launches:
        args = [*launch.args]
        if launch.metrics_out is not None:
            args += ["--lossfix-metrics-out", str(launch.metrics_out)]
        tree = Path(launch.megatron_lm_path).resolve()
        script = launch.script if launch.module else tree / launch.script
        preload = launch.preload
        if preload is None:  # a script of the tree is preloaded from it
            in_tree = not launch.module and Path(script).resolve().is_relative_to(tree)
            preload = [Path(script).stem] if in_tree else []
        jobs.append(Job(script=script, args=args, nproc=launch.nproc, cwd=tree,
                        env=megatron_lm_env(tree) | launch.env, preload=list(preload),
                        module=launch.module,
                        torchrun=launch.torchrun or not preload))  # fmt: skip
    results = []
    done = launch_side_by_side(jobs, timeout=timeout)
    for launch, result in zip(launches, done, strict=True):
        logged = [
            {"iteration": int(m[1]), "lm_loss": float(m[2]), "grad_norm": float(m[3])}
            for m in _LOG_LINE.finditer(result.output)
        ]
        metrics = []
        path = launch.metrics_out
        if path is not None and Path(path).exists():
            metrics = [json.loads(line) for line in Path(path).read_text().splitlines()]
        results.append(RunResult(result.returncode, result.output, logged, metrics))
    return results


def archives_folder() -> Path | None:
    """The folder ``MEGATRON_LM_ARCHIVES`` names, or None when unset or not a folder."""
    folder = os.environ.get(ARCHIVES_ENV)
    return Path(folder).resolve() if folder and Path(folder).is_dir() else None


def archive_tags(folder: str | os.PathLike) -> list[str]:
    """The tags (and ``main``) whose archive lies in ``folder``, sorted."""
    return sorted(p.name[: -len(".tar.gz")] for p in Path(folder).glob("*.tar.gz"))


def release_tag(folder: str | os.PathLike, version: str | None = None) -> str | None:
    """The archive of megatron-core ``version``'s release series (the installed one by default):
    ``core_v0.19.0`` for 0.19.2; the newest patch release there is, or None."""
    if version is None:
        from importlib import metadata

        version = metadata.version("megatron-core")
    series = ".".join(version.split(".")[:2])
    candidates = [t for t in archive_tags(folder) if t.startswith(f"core_v{series}.")]
    return max(candidates, key=lambda t: [int(x) for x in re.findall(r"\d+", t)], default=None)


def tags_to_test(folder: str | os.PathLike) -> list[str]:
    """``MEGATRON_LM_TAGS`` (comma-separated, ``all`` for every archive), else the installed
    release's tag; empty when its archive is missing."""
    wanted = os.environ.get(TAGS_ENV, "").strip()
    if wanted == "all":
        return archive_tags(folder)
    if wanted:
        return [t.strip() for t in wanted.split(",") if t.strip()]
    tag = release_tag(folder)
    return [tag] if tag else []


def skip_reason(folder: str | os.PathLike | None) -> str:
    """Why a test that trains or tests Megatron-LM sources has none to use, in one line: a
    missing input (``helpers.inputs``), which fails the test under CI."""
    if folder is None:
        return MISSING + NEEDS_ARCHIVES
    return MISSING + f"no archive of megatron-core's release tag (or of {TAGS_ENV}) in {folder}"


def unpack_tag(folder: str | os.PathLike, tag: str, dest: str | os.PathLike) -> Path:
    """Unpack ``folder/<tag>.tar.gz`` under ``dest``; returns its ``Megatron-LM`` tree."""
    archive = Path(folder) / f"{tag}.tar.gz"
    if not archive.is_file():
        raise FileNotFoundError(f"{archive} not found; {NEEDS_ARCHIVES}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        if sys.version_info >= (3, 12):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)  # noqa: S202 (our own test inputs)
    tree = dest / "Megatron-LM"
    if not (tree / "megatron").is_dir():
        raise FileNotFoundError(f"{archive} does not unpack to Megatron-LM/megatron")
    return tree


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "write-data":
        sys.exit("usage: python -m helpers.megatron_lm_run write-data PREFIX MEGATRON_LM_PATH")
    print(write_padded_dataset(sys.argv[2], eod=checkout_null_tokenizer_eod(sys.argv[3])))
