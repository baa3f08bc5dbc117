"""The Megatron-LM patch tool (``python -m megatron_lossfix.patches``).

Without a Megatron-LM checkout, the tool's logic runs on a tiny synthetic tree with its own tiny
patch (no Megatron-LM code is copied here): state detection, idempotent apply and revert, refusal
of wrong targets, version selection, both backends (git, patch). Every patch of the repository
is then applied to a tree rebuilt from its own hunks (the lines it expects, at the places it
expects them) and reverted, and each release series must choose its own patch. With a
folder of Megatron-LM source archives (``MEGATRON_LM_ARCHIVES``: the tags and main), each tag's
real tree is patched and reverted the same way, and a patched copy leaves its source alone;
``tests/test_megatron_lm.py`` trains with it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.inputs import needs_input
from helpers.megatron_lm_run import NEEDS_ARCHIVES, archives_folder, unpack_tag

from megatron_lossfix.integrations.megatron_lm import patches
from megatron_lossfix.integrations.megatron_lm.patches import PatchError, State

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

pytestmark = pytest.mark.unit

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


@pytest.mark.parametrize("where", ["missing", "empty", "archives"])
def test_rl_replay_compare_says_what_patches_apply_says(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture
) -> None:
    """``rl-replay compare`` on a directory that is no Megatron-LM checkout (none at all, an
    empty one, the folder of the source archives: the easiest mistake) says what ``patches
    apply`` says of it, not that ``train_rl.py`` is unpatched."""
    from megatron_lossfix.__main__ import main

    target = tmp_path / where
    if where != "missing":
        target.mkdir()
    if where == "archives":
        (target / "core_v0.19.0.tar.gz").write_bytes(b"")
    assert main(["patches", "apply", str(target)]) == 2
    said = capsys.readouterr().err.strip().removeprefix("error: ")
    assert main(["rl-replay", "compare", str(target), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().out.strip() == f"megatron_lossfix: {said}"
    assert "Megatron-LM checkout" in said and "train_rl.py" not in said, said


def test_version_selection(tmp_path: Path, patch_dir: Path) -> None:
    # Another version whose files still fit: the patch is used, and the note says so.
    other = _make_tree(tmp_path / "other", ("9", "8", "0", ""))
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
    assert patches.main(["check", str(tree)]) == 0
    with pytest.raises(SystemExit):  # the old `status` alias of check is gone
        patches.main(["status", str(tree)])
    assert "invalid choice: 'status'" in capsys.readouterr().err
    assert patches.main(["revert", str(tree)]) == 0
    assert patches.main(["check", str(tree.parent / "nowhere")]) == 2
    assert "error:" in capsys.readouterr().err
    assert patches.main(["list"]) == 0
    assert "synthetic_9.9.9: Megatron-Core 9.9.9" in capsys.readouterr().out


def test_repository_patches_are_found_and_well_formed() -> None:
    infos = patches.available_patches()
    assert {i.version for i in infos} >= {"0.16.1", "0.17.1", "0.18.2", "0.19.1", "main"}
    assert patches.patches_dir() == Path(patches.__file__).resolve().parents[3] / "patches"
    for info in infos:
        assert {"pretrain_gpt.py", "train_rl.py"} <= set(info.files)
        # Our code is called, never copied: each script's diff stays a few lines.
        added: dict[str, int] = {}
        for line in info.path.read_text().splitlines():
            if line.startswith("+++ b/"):
                target = line[6:]
            elif line.startswith("+"):
                added[target] = added.get(target, 0) + 1
        assert max(added.values()) <= 16, f"{info.name} adds {added} lines"


# ------------------------------------------------------------------ each patch, on its own lines
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@")


def _tree_from_patch(root: Path, info: patches.PatchInfo, version: str) -> Path:
    """A tree holding, for each file the patch touches, exactly the lines its hunks expect at
    the line numbers they name (filler elsewhere): what a checkout of that release looks like
    to ``git apply`` and ``patch``, rebuilt from our own diff."""
    major, minor, micro = version.split(".")
    tree = _make_tree(root, (major, minor, micro, ""))
    files: dict[str, list[str]] = {}
    # Trailing context lines after each file's last change: fewer than diff's 3 mean the hunk
    # ends the file (``patch --fuzz=0`` then applies it there only), so nothing may follow.
    trailing: dict[str, int] = {}
    current = name = None
    for line in info.path.read_text().splitlines():
        if line.startswith("+++ b/"):
            name = line[6:]
            current = files.setdefault(name, [])
        elif line.startswith("--- a/"):
            current = None  # the next file's header
        elif current is not None and (m := _HUNK.match(line)):
            start = int(m[1])
            current.extend(f"# filler {i}" for i in range(len(current) + 1, start))
        elif current is not None and line[:1] in (" ", "-", "+", ""):
            if line[:1] == " " or line == "":
                # A context line (an empty one keeps no leading space).
                trailing[name] = trailing.get(name, 0) + 1
                current.append(line[1:])
            else:
                trailing[name] = 0
                if line[:1] == "-":
                    current.append(line[1:])
    for name, lines in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        end = [] if trailing.get(name, 3) < 3 else ["# end"]
        (tree / name).write_text("\n".join([*lines, *end]) + "\n")
    return tree


def _release_patches() -> list[patches.PatchInfo]:
    return [i for i in patches.available_patches() if i.version != "main"]


def _newer_than_releases() -> str:
    """A version after every release patch: what the development branch reports."""
    newest = max(tuple(int(x) for x in i.version.split(".")[:2]) for i in _release_patches())
    return f"{newest[0]}.{newest[1] + 1}.0"


@pytest.mark.parametrize("info", patches.available_patches(), ids=lambda i: i.name)
def test_each_patch_is_chosen_for_its_version_and_round_trips(
    tmp_path: Path, info: patches.PatchInfo, backend: str
) -> None:
    version = _newer_than_releases() if info.version == "main" else info.version
    tree = _tree_from_patch(tmp_path / "tree", info, version)
    pristine = {f: (tree / f).read_bytes() for f in info.files}
    chosen, state, note = patches.select_patch(tree)
    assert (chosen.name, state) == (info.name, State.NOT_APPLIED), note
    patches.apply(tree)
    patched = {f: (tree / f).read_text() for f in info.files}
    assert patches.check(tree) is State.APPLIED
    assert "already applied" in patches.apply(tree)
    assert {f: (tree / f).read_text() for f in info.files} == patched
    # The hooks our integration needs, and nothing of Megatron's own code removed but edited lines.
    assert "lossfix_lm.enable_cpu_megatron_lm()" in patched["pretrain_gpt.py"]
    assert "lossfix=None" in patched["pretrain_gpt.py"]
    assert "wrap_forward_backward_func" in patched["megatron/training/training.py"]
    patches.revert(tree)
    assert {f: (tree / f).read_bytes() for f in info.files} == pristine
    assert "nothing to revert" in patches.revert(tree)
    assert not list(tree.rglob("*.orig")) and not list(tree.rglob("*.rej"))


def test_release_series_and_development_branch_selection(tmp_path: Path) -> None:
    by_version = {i.version: i for i in patches.available_patches()}
    # Other patch releases of a series take that series' patch, even where another fits too
    # (the 0.19 patch and the main patch make the same edits to pretrain_gpt.py, training.py and
    # train_rl.py at other line numbers; their edits to megatron/rl/rl_utils.py differ).
    info = by_version["0.19.1"]
    for version in ("0.19.0", "0.19.2"):
        tree = _tree_from_patch(tmp_path / version, info, version)
        chosen, _, note = patches.select_patch(tree)
        assert chosen.name == info.name and "same release series" in note, note
    # A version newer than every release takes the main patch (the 0.19 one does not fit: main
    # builds the RL rows in other code).
    main = by_version["main"]
    tree = _tree_from_patch(tmp_path / "dev", main, _newer_than_releases())
    assert patches.select_patch(tree, "0.19.1")[1] is State.CONFLICT
    chosen, _, note = patches.select_patch(tree)
    assert chosen.name == main.name and "development branch" in note, note
    # A release's own patch refuses another release's tree (they differ where they edit).
    tree = _tree_from_patch(tmp_path / "old", by_version["0.16.1"], "0.16.1")
    assert patches.select_patch(tree, "0.18.2")[1] is State.CONFLICT


# ------------------------------------------------------- the tags, from Megatron-LM source archives
#: Megatron-LM ref -> the patch ``patches check`` must choose for it.
TAG_PATCHES = {
    "core_v0.16.1": "megatron_lm_core_v0.16.1",
    "core_v0.17.1": "megatron_lm_core_v0.17.1",
    "core_v0.18.2": "megatron_lm_core_v0.18.2",
    "core_v0.19.0": "megatron_lm_core_v0.19.0",
    "main": "megatron_lm_main",
}
ARCHIVES = archives_folder()
needs_archives = needs_input(ARCHIVES is not None, NEEDS_ARCHIVES)


@needs_archives
@pytest.mark.parametrize("ref", TAG_PATCHES)
def test_tag_chooses_its_patch_and_round_trips(tmp_path: Path, ref: str) -> None:
    """Each ref's real tree (unpacked from its archive): the right patch is chosen, applies,
    checks as applied, is idempotent, and reverts to the exact original files."""
    tree = unpack_tag(ARCHIVES, ref, tmp_path)
    pristine = {p: p.read_bytes() for p in tree.rglob("*.py")}
    chosen, state, note = patches.select_patch(tree)
    assert (chosen.name, state) == (TAG_PATCHES[ref], State.NOT_APPLIED), note
    assert patches.main(["apply", str(tree)]) == 0
    assert patches.main(["check", str(tree)]) == 0
    assert "already applied" in patches.apply(tree)
    assert "[megatron_lossfix]" in (tree / "pretrain_gpt.py").read_text()
    assert patches.main(["revert", str(tree)]) == 0
    assert patches.check(tree) is State.NOT_APPLIED
    assert {p: p.read_bytes() for p in tree.rglob("*.py")} == pristine


@needs_archives
def test_patched_copy_leaves_the_source_tree_alone(tmp_path: Path) -> None:
    from helpers.megatron_lm_run import patched_copy

    source = unpack_tag(ARCHIVES, "core_v0.16.1", tmp_path / "source")
    before = {p: p.read_bytes() for p in source.rglob("*.py")}
    copy = patched_copy(source, tmp_path / "Megatron-LM")
    files = {f: (copy / f).read_text() for f in patches.select_patch(copy)[0].files}
    assert patches.check(copy) is State.APPLIED
    assert "already applied" in patches.apply(copy)
    patches.revert(copy)
    assert patches.check(copy) is State.NOT_APPLIED
    assert "[megatron_lossfix]" not in (copy / "pretrain_gpt.py").read_text()
    patches.apply(copy)
    assert {f: (copy / f).read_text() for f in files} == files
    assert {p: p.read_bytes() for p in source.rglob("*.py")} == before
