"""The CPU command for Megatron-LM's patched ``pretrain_gpt.py`` (docs/megatron_lm.md), run as
printed.

The block that clones Megatron-LM beside the clone, installs what its training
package imports, patches it and trains a tiny GPT on 2 ranks. Here it runs line by line in a
scratch folder laid out as the page assumes (the clone, ``../Megatron-LM`` beside it), with
two stand-ins: the sources of the tag it clones come from ``MEGATRON_LM_ARCHIVES`` (no network),
and ``.venv/bin`` holds ``python``, ``python3``, ``torchrun`` and ``python3-config`` wrappers of
this test's own interpreter (the environment CI built; its install line is not run). Every other
word of each line, the ``PATH`` prefix that ``make`` needs included, runs as printed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import doc_pages
from helpers.inputs import skip_missing
from helpers.launch import slots
from helpers.megatron_lm_run import archives_folder, unpack_tag

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def _block() -> list[str]:
    """The lines of the pages' bash block that clones Megatron-LM and runs it on a CPU."""
    for _, lang, body in doc_pages.blocks("bash"):
        if "git clone" in body and "pretrain_gpt.py" in body:
            return doc_pages.block_commands(lang, body)
    raise AssertionError("no page has a bash block that clones and runs Megatron-LM")


def _wrappers(bin_dir: Path) -> None:
    """``.venv/bin`` standing for this interpreter's environment."""
    bin_dir.mkdir(parents=True)
    python = shlex.quote(sys.executable)
    config = Path(
        sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}-config"
    )
    scripts = {
        "python": f'exec {python} "$@"',
        "python3": f'exec {python} "$@"',
        "torchrun": f'exec {python} -m torch.distributed.run "$@"',
    }
    if config.exists():  # make asks python3-config for the extension suffix and the headers
        scripts["python3-config"] = f'exec {shlex.quote(str(config))} "$@"'
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)


def test_readme_cpu_command_runs_as_printed(tmp_path):
    lines = _block()
    clone = next(line for line in lines if line.startswith("git clone"))
    tag = re.search(r"--branch (\S+)", clone)[1]
    folder = archives_folder()
    if folder is None or not (folder / f"{tag}.tar.gz").is_file():
        skip_missing(f"MEGATRON_LM_ARCHIVES with {tag}.tar.gz (the tag the page clones)")
    work = tmp_path / "clone"
    work.mkdir()
    assert clone.split()[-1] == "../Megatron-LM", clone
    unpack_tag(folder, tag, tmp_path)  # -> tmp_path / "Megatron-LM": the clone's sibling
    _wrappers(work / ".venv" / "bin")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ran = []
    for line in lines:
        if line.startswith("git clone") or re.match(r"^\S*/bin/pip install ", line):
            continue  # the stand-ins above
        with slots(2):
            proc = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True,
                                  text=True, timeout=1200)  # fmt: skip
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{line}\nexit {proc.returncode}:\n{output[-5000:]}"
        ran.append((line, output))
    run_line, output = ran[-1]
    assert "pretrain_gpt.py" in run_line and "--loss-reduction token_mean" in run_line
    iterations = re.findall(r"iteration\s+(\d+)/\s*3 \|.*lm loss: ([\d.E+-]+)", output)
    assert [int(i) for i, _ in iterations] == [1, 2, 3], output[-5000:]
    assert re.search(r"loss_reduction \.+ token_mean", output), "the plugin's flag did not reach it"
    # The helpers were built by the run, with this interpreter's extension suffix.
    built = list((tmp_path / "Megatron-LM" / "megatron" / "core" / "datasets").glob("helpers*.so"))
    assert built and shutil.which("make"), built
