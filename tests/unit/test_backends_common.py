"""The pure parts of dsec.backends.common, which the container and gVisor backends share:
the layer stack an ImageRef names, and a command's user and environment. (Their I/O parts,
layer pins and output collection, run in tests/conformance against both backends.)"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dsec.backends.common.command import DEFAULT_ENV, UID_RANGE, check_argv, command_env, user_ids
from dsec.backends.common.layers import stack
from dsec.errors import InvalidSpec
from dsec.images.layer import LayerKind
from dsec.spec import ImageRef

# A store of five layers: digests by name, their kinds, a snapshot's parents (top first).
D = {n: "sha256:" + c * 64 for n, c in (("base", "a"), ("ws", "b"), ("tk", "c"), ("snap", "d"), ("other", "e"))}
KINDS = {D["base"]: LayerKind.BASE, D["ws"]: LayerKind.WORKSPACE, D["tk"]: LayerKind.TOOLKIT,
         D["snap"]: LayerKind.SNAPSHOT, D["other"]: LayerKind.BASE}
PARENTS = {D["snap"]: (D["ws"], D["base"])}


def plan(image: ImageRef, max_layers: int = 15) -> list[str]:
    def lineage(d: str) -> Sequence[str] | None:
        return PARENTS.get(d)

    return stack(image, resolve=lambda ref: D.get(ref, ref), kind_of=KINDS.__getitem__, lineage_of=lineage,
                 max_layers=max_layers)


def test_stack_is_top_first_and_a_snapshot_brings_its_lineage() -> None:
    assert plan(ImageRef(base="base", workspace="ws", toolkits=("tk",))) == [D["tk"], D["ws"], D["base"]]
    assert plan(ImageRef(base="snap")) == [D["snap"], D["ws"], D["base"]]
    assert plan(ImageRef(base="snap", toolkits=("tk",))) == [D["tk"], D["snap"], D["ws"], D["base"]]


def test_stack_refuses_a_bottom_that_is_no_system_a_foreign_lineage_and_depth() -> None:
    with pytest.raises(InvalidSpec, match="workspace layer, not a base") as exc:
        plan(ImageRef(base="ws"))
    assert exc.value.to_wire()["field"] == "image.base"
    with pytest.raises(InvalidSpec, match="taken over other layers"):
        plan(ImageRef(base="other", toolkits=("snap",)))
    with pytest.raises(InvalidSpec, match="stacks 3 layers; a sandbox can mount at most 2"):
        plan(ImageRef(base="snap"), max_layers=2)


def test_user_ids_and_command_env() -> None:
    assert user_ids(0) == (0, 0) and user_ids("root") == (0, 0) and user_ids("1000:100") == (1000, 100)
    for bad in ("nobody", UID_RANGE, "1:65536", -1):
        with pytest.raises(InvalidSpec):
            user_ids(bad)
    assert command_env({"A": "1", "TERM": "xterm"}, {"A": "2"}) == {**DEFAULT_ENV, "A": "2", "TERM": "xterm"}
    for name, value in (("", "x"), ("A=B", "x"), ("A\0", "x"), ("A", "x\0")):
        with pytest.raises(InvalidSpec, match="bad environment variable"):
            command_env({}, {name: value})
    check_argv("sb-1", ["true"], "/")
    for argv, cwd in (([], "/"), ([""], "/"), (["true"], "tmp")):
        with pytest.raises(InvalidSpec):
            check_argv("sb-1", argv, cwd)
