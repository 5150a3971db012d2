"""The Python half of stages: what the runtime sends the spawner (the walk itself is C)."""

from __future__ import annotations

import pytest

from dsec.backends.container.stages import check_pristine, landlock, restricted_paths
from dsec.errors import InvalidSpec
from dsec.spec import FileRules


def landlock_tokens(rules: FileRules) -> tuple[tuple[str, str], ...]:
    """What goes on the wire for ``rules`` (the spawner's ``ld``/``lr`` fields)."""
    ll = landlock(rules)
    return () if ll is None else tuple(ll.encode())


def test_unrestricted_rules_send_nothing() -> None:
    # The no-stage fast path: no Landlock at all, not even an empty ruleset.
    assert landlock_tokens(FileRules()) == ()
    assert landlock_tokens(FileRules(writable=("/workspace",))) == ()


def test_rules_become_tokens_with_dev_writable() -> None:
    toks = landlock_tokens(FileRules(hidden=("/tests",), read_only=("/usr",), writable=("/workspace",)))
    assert toks == (("ld", "w"), ("lr", "h:/tests"), ("lr", "r:/usr"), ("lr", "w:/workspace"), ("lr", "w:/dev"))
    assert landlock_tokens(FileRules(default="ro"))[0] == ("ld", "r")


def test_dev_left_alone_when_named() -> None:
    toks = landlock_tokens(FileRules(default="ro", read_only=("/dev/shm",)))
    assert ("lr", "w:/dev") not in toks
    toks = landlock_tokens(FileRules(default="ro", hidden=("/dev",)))
    assert ("lr", "w:/dev") not in toks
    # A rule on the root does not count as naming /dev.
    assert ("lr", "w:/dev") in landlock_tokens(FileRules(read_only=("/",)))


def test_check_pristine() -> None:
    assert check_pristine(["/usr/bin", "/tests", "/usr/bin/python3", "/tests"]) == ("/usr/bin", "/tests")
    for bad in (["relative"], ["/"], ["/a/../b"], ["/a//b"], ["/a\0b"]):
        with pytest.raises(InvalidSpec):
            check_pristine(bad)
    with pytest.raises(InvalidSpec, match="list of paths"):
        check_pristine("/tests")
    with pytest.raises(InvalidSpec, match="at most"):
        check_pristine([f"/p{i}" for i in range(65)])


def test_restricted_paths() -> None:
    assert restricted_paths(FileRules(hidden=("/a",), read_only=("/b",), writable=("/c",))) == ("/a", "/b")


def test_access_class_deepest_rule_wins() -> None:
    from dsec.backends.container.stages import access_class

    rules = FileRules(default="ro", writable=("/workspace",), hidden=("/workspace/private",),
                      read_only=("/workspace/private/open",))
    assert access_class("/etc/passwd", rules) == "r"
    assert access_class("/workspace/a", rules) == "w"
    assert access_class("/workspace/private/k", rules) == "h"
    assert access_class("/workspace/private/open/n", rules) == "r"
    assert access_class("/workspace/privateer", rules) == "w"
    assert access_class("/dev/null", rules) == "w"
    assert access_class("/x", FileRules(hidden=("/tests",))) == "w"
