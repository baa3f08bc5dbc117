"""The Megatron-LM patch tool (``python -m megatron_lossfix.patches``) and the patched
``pretrain_gpt.py``.

Without a Megatron-LM checkout, the tool's logic runs on a tiny synthetic tree with its own tiny
patch (no Megatron-LM code is copied here): state detection, idempotent apply and revert, refusal
of wrong targets, version selection, both backends (git, patch). With ``MEGATRON_LM_PATH`` set
to a Megatron-LM checkout (tag core_v0.16.1, patched or not), the real patch is applied to a
temporary copy and the patched ``pretrain_gpt.py`` trains on CPU under two micro-batch sizes:
with ``--loss-reduction token_mean`` the logged loss and grad norm agree; stock, they do not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_lossfix import patches
from megatron_lossfix.patches import PatchError, State

ORIGINAL = "def greet():\n    return 'hello'\n\n\nprint(greet())\n"
PATCHED = "def greet():\n    return 'hello, world'\n\n\nprint(greet())\n"
SYNTHETIC_PATCH = "\n".join(
    [
        "Synthetic patch for the tests.",
        "Megatron-Core-Version: 9.9.9",
        "",
        "--- a/greet.py",
        "+++ b/greet.py",
        "@@ -1,5 +1,5 @@",
        " def greet():",
        "-    return 'hello'",
        "+    return 'hello, world'",
        " ",
        " ",
        " print(greet())",
        "",
    ]
)

BACKENDS = [b for b in ("git", "patch") if shutil.which(b)]


def _make_tree(root: Path, version: tuple[str, str, str, str] = ("9", "9", "9", "")) -> Path:
    """A directory that looks like a Megatron-LM checkout to the tool, holding ``greet.py``."""
    major, minor, patch, pre = version
    (root / "megatron/core").mkdir(parents=True)
    (root / "megatron/training").mkdir(parents=True)
    (root / "megatron/core/package_info.py").write_text(
        f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = '{pre}'\n"
    )
    (root / "megatron/training/__init__.py").write_text("")
    (root / "greet.py").write_text(ORIGINAL)
    return root


@pytest.fixture
def patch_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "patches"
    directory.mkdir()
    (directory / "synthetic_9.9.9.patch").write_text(SYNTHETIC_PATCH)
    return directory


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return _make_tree(tmp_path / "megatron-lm")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with git, then with GNU patch (git hidden), where installed."""
    if request.param == "patch":
        which = shutil.which
        monkeypatch.setattr(patches.shutil, "which", lambda n: None if n == "git" else which(n))
    return request.param


def test_apply_check_revert_cycle(tree: Path, patch_dir: Path, backend: str) -> None:
    assert patches.check(tree, directory=patch_dir) is State.NOT_APPLIED
    message = patches.apply(tree, directory=patch_dir)
    assert "applied" in message and "already" not in message
    assert (tree / "greet.py").read_text() == PATCHED
    assert patches.check(tree, directory=patch_dir) is State.APPLIED

    # Idempotent: a second apply says so and changes nothing.
    message = patches.apply(tree, directory=patch_dir)
    assert "already applied" in message
    assert (tree / "greet.py").read_text() == PATCHED

    message = patches.revert(tree, directory=patch_dir)
    assert "reverted" in message
    assert (tree / "greet.py").read_text() == ORIGINAL
    assert "nothing to revert" in patches.revert(tree, directory=patch_dir)
    assert (tree / "greet.py").read_text() == ORIGINAL


def test_conflicting_tree_is_refused_unchanged(tree: Path, patch_dir: Path, backend: str) -> None:
    edited = ORIGINAL.replace("'hello'", "'bonjour'")
    (tree / "greet.py").write_text(edited)
    for operation in (patches.apply, patches.revert, patches.check):
        with pytest.raises(PatchError, match="differ from what"):
            operation(tree, directory=patch_dir)
    assert (tree / "greet.py").read_text() == edited
    assert not list(tree.glob("*.orig")) and not list(tree.glob("*.rej"))


def test_wrong_targets(tmp_path: Path, patch_dir: Path) -> None:
    with pytest.raises(PatchError, match="not a directory"):
        patches.apply(tmp_path / "missing", directory=patch_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PatchError, match="not a Megatron-LM checkout"):
        patches.apply(tmp_path / "empty", directory=patch_dir)
    # A Megatron-LM-looking tree without the file the patch touches.
    tree = _make_tree(tmp_path / "no-greet")
    (tree / "greet.py").unlink()
    with pytest.raises(PatchError, match="greet.py"):
        patches.apply(tree, directory=patch_dir)


def test_version_selection(tmp_path: Path, patch_dir: Path) -> None:
    # Another version whose files still fit: the patch is used, and the note says so.
    other = _make_tree(tmp_path / "other", ("9", "9", "8", ""))
    info, state, note = patches.select_patch(other, directory=patch_dir)
    assert info.version == "9.9.9" and state is State.NOT_APPLIED
    assert "no patch of its own" in note
    # Another version whose files do not fit: refused, naming the supported versions.
    (other / "greet.py").write_text("something else\n")
    with pytest.raises(PatchError, match=r"which no patch supports \(supported: 9\.9\.9"):
        patches.apply(other, directory=patch_dir)
    # A patch chosen by name, or by version.
    tree = _make_tree(tmp_path / "named")
    assert patches.select_patch(tree, "synthetic_9.9.9", patch_dir)[0].version == "9.9.9"
    assert patches.select_patch(tree, "9.9.9", patch_dir)[0].name == "synthetic_9.9.9"
    with pytest.raises(PatchError, match="no patch named"):
        patches.select_patch(tree, "nope", patch_dir)


def test_version_parsing(tmp_path: Path) -> None:
    assert patches.megatron_core_version(_make_tree(tmp_path / "a")) == "9.9.9"
    assert patches.megatron_core_version(_make_tree(tmp_path / "b", ("0", "17", "0", "rc2"))) == (
        "0.17.0rc2"
    )


def test_patch_without_version_header_is_refused(tmp_path: Path, tree: Path) -> None:
    directory = tmp_path / "bad"
    directory.mkdir()
    (directory / "bad.patch").write_text(SYNTHETIC_PATCH.replace("Megatron-Core-Version", "V"))
    with pytest.raises(PatchError, match="Megatron-Core-Version"):
        patches.apply(tree, directory=directory)


@pytest.mark.skipif("git" not in BACKENDS, reason="needs git")
def test_target_inside_another_git_repository(tmp_path: Path, patch_dir: Path) -> None:
    # `git apply` run inside an enclosing repository would resolve paths from its root and
    # skip the files: the tool must patch the target all the same.
    outer = tmp_path / "outer"
    outer.mkdir()
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    tree = _make_tree(outer / "third_party" / "Megatron-LM")
    patches.apply(tree, directory=patch_dir)
    assert (tree / "greet.py").read_text() == PATCHED
    patches.revert(tree, directory=patch_dir)
    assert (tree / "greet.py").read_text() == ORIGINAL


def test_command_line_exit_codes(
    tree: Path, patch_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("MEGATRON_LOSSFIX_PATCHES", str(patch_dir))
    assert patches.main(["check", str(tree)]) == 1
    assert patches.main(["apply", str(tree)]) == 0
    assert patches.main(["apply", str(tree)]) == 0
    assert "already applied" in capsys.readouterr().out
    assert patches.main(["status", str(tree)]) == 0
    assert patches.main(["revert", str(tree)]) == 0
    assert patches.main(["check", str(tree.parent / "nowhere")]) == 2
    assert "error:" in capsys.readouterr().err
    assert patches.main(["list"]) == 0
    assert "synthetic_9.9.9: Megatron-Core 9.9.9" in capsys.readouterr().out


def test_repository_patches_are_found_and_well_formed() -> None:
    infos = patches.available_patches()
    assert {i.version for i in infos} >= {"0.16.1"}
    assert patches.patches_dir() == Path(patches.__file__).resolve().parent.parent / "patches"
    for info in infos:
        assert "pretrain_gpt.py" in info.files
        text = info.path.read_text()
        # Our code is called, never copied: the diffs stay a few lines.
        added = [ln for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        assert len(added) <= 25, f"{info.name} adds {len(added)} lines"


# ---------------------------------------------------------------------------------- real checkout
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")
needs_megatron_lm = pytest.mark.skipif(
    not MEGATRON_LM_PATH, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout"
)


@pytest.fixture(scope="module")
def patched_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout (what pretrain_gpt.py needs) with our patch applied."""
    source = Path(MEGATRON_LM_PATH)
    copy = tmp_path_factory.mktemp("megatron-lm") / "Megatron-LM"
    copy.mkdir()
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        shutil.copy2(source / name, copy / name)
    shutil.copytree(
        source / "megatron", copy / "megatron", ignore=shutil.ignore_patterns("__pycache__")
    )
    patches.apply(copy)  # no-op when the source was already patched
    return copy


@needs_megatron_lm
def test_real_checkout_apply_revert_cycle(patched_copy: Path) -> None:
    files = {f: (patched_copy / f).read_text() for f in patches.select_patch(patched_copy)[0].files}
    assert patches.check(patched_copy) is State.APPLIED
    assert "already applied" in patches.apply(patched_copy)
    patches.revert(patched_copy)
    assert patches.check(patched_copy) is State.NOT_APPLIED
    assert "[megatron_lossfix]" not in (patched_copy / "pretrain_gpt.py").read_text()
    patches.apply(patched_copy)
    assert {f: (patched_copy / f).read_text() for f in files} == files


@needs_megatron_lm
def test_patched_pretrain_gpt_is_invariant_to_micro_batch_size(
    patched_copy: Path, tmp_path: Path
) -> None:
    from megatron_lossfix.testing.megatron_lm_run import (
        run_pretrain_gpt,
        tiny_gpt_args,
        write_padded_dataset,
    )

    data = write_padded_dataset(tmp_path / "data" / "padded")

    def run(micro_batch_size: int, *flags: str) -> list[dict]:
        args = tiny_gpt_args(micro_batch_size=micro_batch_size, train_iters=2, data_path=data)
        result = run_pretrain_gpt(
            patched_copy, [*args, *flags], metrics_out=tmp_path / f"m{micro_batch_size}.jsonl"
        )
        assert result.returncode == 0, result.output[-4000:]
        assert [r["iteration"] for r in result.metrics] == [1, 2], result.output[-4000:]
        return result.metrics

    # The runtime self-check re-splits the first step (4 -> 2 x 2 per micro-batch) and would
    # raise if the gradient moved.
    fixed = {
        1: run(1, "--loss-reduction", "token_mean"),
        4: run(4, "--loss-reduction", "token_mean", "--lossfix-self-check"),
    }
    for a, b in zip(fixed[1], fixed[4], strict=True):
        assert a["num_tokens"] == b["num_tokens"] < 2 * 8 * 64  # the masks are far from all ones
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["lm_loss"] == pytest.approx(a["loss"], rel=1e-5)  # Megatron-LM logs L
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # `off` is stock Megatron: the same data, another gradient per micro-batch size.
    stock = {mbs: run(mbs, "--loss-reduction", "off") for mbs in (1, 4)}
    assert stock[1][0]["grad_norm"] != pytest.approx(stock[4][0]["grad_norm"], rel=1e-3)
