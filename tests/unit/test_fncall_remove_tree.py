"""The FnCall cleaner's tree removal (issue 22): any depth, odd modes, and a tree moved under it
by a concurrent call never makes it touch anything outside the tree. Real files in a temp dir."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.fncall import worker


def _deep(top: Path, depth: int) -> None:
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d" * 200, dir_fd=fd)
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
        nfd = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.symlink("/", "to-root", dir_fd=fd)
    os.close(fd)


def test_a_tree_deeper_than_path_max_wide_and_with_links_goes(tmp_path: Path) -> None:
    top = tmp_path / "scratch"
    top.mkdir()
    _deep(top, 3000)  # ~600 KB of path: no path-based walk can do it
    wide = top / "wide"
    wide.mkdir()
    for i in range(3000):
        (wide / str(i)).mkdir() if i % 2 else (wide / str(i)).write_text("x")
    (top / "link-out").symlink_to(tmp_path)
    keep = tmp_path / "keep"
    keep.write_text("outside")
    worker.remove_tree(str(top))
    assert not top.exists() and keep.read_text() == "outside"


def test_a_directory_moved_out_under_the_cleaner_stops_it_at_the_tree(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A concurrent call moves a directory of the tree (one the dead call opened to every uid)
    into its own scratch while the cleaner is below it: climbing '..' would then lead the
    cleaner into the other call's tree, where names it still has to visit could be anyone's."""
    top = tmp_path / "scratch"
    (top / "a" / "b" / "c").mkdir(parents=True)
    (top / "a" / "sibling").mkdir()  # still to visit when the cleaner comes back up to a
    elsewhere = tmp_path / "other-scratch"
    (elsewhere / "sibling").mkdir(parents=True)  # a same-named directory where the climb would land
    victim = elsewhere / "sibling" / "victim"
    victim.write_text("not the dead call's")
    c_ino = (top / "a" / "b" / "c").stat().st_ino
    real = worker._clear_dir
    moved: list[bool] = []

    def clear_and_move(fd: int) -> list[str]:
        if os.fstat(fd).st_ino == c_ino and not moved:
            os.rename(top / "a" / "b", elsewhere / "b")  # the partner's move
            moved.append(True)
        return sorted(real(fd), key=lambda n: n == "b")  # "b" is visited first: "sibling" is still to go

    monkeypatch.setattr(worker, "_clear_dir", clear_and_move)
    with pytest.raises(OSError, match="moved out"):
        worker.remove_tree(str(top))
    assert moved and victim.read_text() == "not the dead call's"
    assert (top / "a" / "sibling").is_dir()  # left for a later try, untouched by the climb


def test_the_cleaner_sets_a_tree_it_cannot_remove_aside_and_tries_again(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    sup: Any = worker.Supervisor()
    tree = tmp_path / "s"
    (tree / "x").mkdir(parents=True)
    calls: list[str] = []

    def failing(path: str) -> None:
        calls.append(path)
        raise OSError(18, "moved")

    monkeypatch.setattr(worker, "remove_tree", failing)
    sup.clean_one(str(tree))
    assert calls == [str(tree)] and not sup.cleaner_failed
    assert [p for _, p in sup.retry] == [str(tree)]
    st = tree.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)


def test_the_host_inotify_limit_is_raised_not_lowered(tmp_path: Path) -> None:
    """Every sandbox's inotify instances count against host root's limit (128 on Debian): one
    call or sandbox holding 128 took inotify from all (issue 22's red team)."""
    from dsec.backends.container.hostcheck import INOTIFY_INSTANCES, tune_inotify

    f = tmp_path / "max_user_instances"
    f.write_text("128\n")
    assert tune_inotify(f) == INOTIFY_INSTANCES and int(f.read_text()) == INOTIFY_INSTANCES
    f.write_text(f"{INOTIFY_INSTANCES * 4}\n")
    assert tune_inotify(f) is None and int(f.read_text()) == INOTIFY_INSTANCES * 4
    assert tune_inotify(tmp_path / "missing") is None
