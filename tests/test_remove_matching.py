"""agent.guard.remove_matching (scratch directories, shared-memory segments, the guard's
clean-up) removes exactly what ``glob.glob`` names, as ``shutil.rmtree``/``os.unlink``
would, on generated trees, including the patterns it takes with os alone (a plain path,
``DIR/PREFIX*``), hidden names, nested directories and links."""

from __future__ import annotations

import glob
import os
import random
import shutil
import subprocess
import sys

import pytest

from distlaunch.agent.guard import remove_matching

NAMES = ["a", "ab", "abc", ".a", ".ab", "b", "a-1", "a[1]", "x*y"]


def _tree(root, rnd):
    """A small random tree under ``root``: files, flat and nested directories, links to
    directories and dangling links."""
    os.makedirs(root)
    for name in rnd.sample(NAMES, rnd.randint(3, len(NAMES))):
        path = os.path.join(root, name)
        kind = rnd.choice(["file", "flat", "nested", "dirlink", "dangling"])
        if kind == "file":
            open(path, "w").close()
        elif kind in ("flat", "nested"):
            os.mkdir(path)
            for k in range(rnd.randint(0, 3)):
                open(os.path.join(path, f"f{k}"), "w").close()
            if kind == "nested":
                os.makedirs(os.path.join(path, "sub", "deeper"))
                open(os.path.join(path, "sub", "deeper", "g"), "w").close()
        elif kind == "dirlink":
            os.mkdir(path + ".target")
            os.symlink(path + ".target", path)
        else:
            os.symlink(os.path.join(root, "missing"), path)


def _reference(pattern):
    """remove_matching as it was: glob, then rmtree or unlink."""
    for path in glob.glob(pattern):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def _left(root):
    return sorted(
        os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files
    )


@pytest.mark.parametrize("seed", range(40))
def test_remove_matching_is_glob_and_rmtree(tmp_path, seed):
    rnd = random.Random(seed)
    for name in [*NAMES, "missing", "a*", "ab*", ".a*", "*", "a?", "[ab]*", "x*y*", "a[1]*"]:
        trees = []
        for way in ("ours", "theirs"):
            root = str(tmp_path / f"{name.replace('*', 'S').replace('?', 'Q')}-{way}")
            _tree(root, random.Random(seed))
            trees.append(root)
        remove_matching(os.path.join(trees[0], name))
        _reference(os.path.join(trees[1], name))
        assert _left(trees[0]) == _left(trees[1]), (seed, name)
    assert rnd  # (the trees are drawn from the seed)


def test_plain_removals_import_neither_glob_nor_shutil(tmp_path):
    """A scratch directory of files and a round's segments (DIR/PREFIX*) are removed
    without importing glob or shutil (with shutil's bz2 and lzma, ~3-10 ms of CPU at
    every agent's end)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "error_0_1.json").write_text("{}")
    (scratch / "progress_0_1").write_text("")
    for name in ("dl_run_7_0_a", "dl_run_7_0_b", "dl_other"):
        (tmp_path / name).write_text("")
    code = (  # (where the interpreter's site loads one already, it is not counted)
        "import sys; before = set(sys.modules); from distlaunch.agent.guard import remove_matching; "
        f"remove_matching({str(scratch)!r}); remove_matching({str(tmp_path / 'dl_run_7_0_')!r} + '*'); "
        "print(sorted(m for m in ('glob', 'shutil', 'fnmatch') if m in set(sys.modules) - before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dl_other"]


@pytest.mark.parametrize("pattern", ["seg", "se*"])
def test_a_link_swapped_in_for_a_directory_keeps_its_target(tmp_path, monkeypatch, pattern):
    """/dev/shm is world-writable: a directory replaced by a link to another directory
    after it was checked (here the instant before its files are listed by path, which
    the old removal did after its isdir/islink check) must not have the target's files
    removed (shutil.rmtree refused the same); the link goes as a plain path, as glob and
    unlink did, and a link there from the start too."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("")
    seg = tmp_path / "seg"
    seg.mkdir()
    (seg / "f").write_text("")
    listdir = os.listdir

    def swapped_before_the_listing(path="."):
        if not isinstance(path, int) and os.fspath(path) == str(seg) and not os.path.islink(seg):
            shutil.rmtree(seg)
            os.symlink(target, seg)
        return listdir(path)

    monkeypatch.setattr(os, "listdir", swapped_before_the_listing)
    remove_matching(str(tmp_path / pattern))
    monkeypatch.undo()
    assert (target / "keep").exists()
    if not os.path.lexists(seg):  # (a link from the start)
        os.symlink(target, seg)
    remove_matching(str(tmp_path / pattern))
    assert not os.path.lexists(seg) and (target / "keep").exists()
