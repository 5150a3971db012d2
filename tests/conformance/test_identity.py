"""A sandbox's own ``/etc/hostname`` and ``/etc/hosts``, whatever its image holds, as Docker gives
each container: its id in ``/etc/hostname`` (and as its hostname), ``localhost`` on 127.0.0.1 and
::1 and its own name on 127.0.1.1 in ``/etc/hosts`` (dsec.backends.common.identity), so a program
that starts a server and talks to ``localhost`` works. Images: one with no ``/etc`` at all (a
layer built from a bare directory), the busybox test layer (an ``/etc`` without either file
before builders wrote a neutral ``/etc/hosts``), one whose files name another machine (a leak
of a build host, or another sandbox's snapshot). The files are the sandbox's to edit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsec.backends.common.identity import hostname_text, hosts_text
from dsec.spec import ImageRef

from .conftest import IMAGE, BackendHarness, add_layer

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]

SERVE = ("mkdir -p /tmp/www && echo served > /tmp/www/x && httpd -p 8089 -h /tmp/www && "
         "for i in 1 2 3 4 5 6 7 8 9 10; do wget -q -O- http://127.0.0.1:8089/x >/dev/null 2>&1 && break; "
         "sleep 0.1; done; ")


WRITTEN_BY_DSEC = ("container", "gvisor")
"""Backends whose sandboxes get dsec.backends.common.identity's text to the byte (a VM's guest
writes its own, with these lines)."""


def required_lines(sid: str) -> set[str]:
    """The lines every sandbox's /etc/hosts holds (whitespace folded)."""
    return {"127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", f"127.0.1.1 {sid}"}


@pytest.fixture(scope="module")
def images(backend: BackendHarness, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ImageRef]:
    from dsec.images import build_from_dir
    from dsec.images.busybox import build_busybox_rootfs

    tmp = tmp_path_factory.mktemp("cf-identity")
    bare = build_busybox_rootfs(tmp / "bare")
    shutil.rmtree(bare / "etc")  # no /etc at all: no hosts, no hostname, no passwd
    build_from_dir(backend.ctx.store, bare, name="cfbare", tag="test", kind="base")
    foreign = add_layer(backend, {"etc/hostname": "buildhost\n", "etc/hosts": "127.0.0.1 buildhost\n"},
                        name="cfforeign", tmp=tmp)
    return {"no /etc": ImageRef(base="cfbare:test"), "busybox": ImageRef(base=IMAGE),
            "another machine's": ImageRef(base=IMAGE, workspace=foreign)}


@pytest.mark.parametrize("which", ["no /etc", "busybox", "another machine's"])
def test_a_sandbox_has_its_own_hostname_and_hosts_whatever_its_image_holds(
        backend: BackendHarness, images: dict[str, ImageRef], which: str) -> None:
    with backend.sandbox(spec=backend.spec().model_copy(update={"image": images[which]})) as rec:
        sid = rec.id
        assert backend.ok(sid, ["cat", "/etc/hostname"]) == hostname_text(sid)
        hosts = backend.ok(sid, ["cat", "/etc/hosts"])
        assert required_lines(sid) <= {" ".join(ln.split()) for ln in hosts.splitlines()}, hosts
        if backend.kind.name in WRITTEN_BY_DSEC:
            assert hosts == hosts_text(sid)
        assert backend.ok(sid, ["hostname"]) == f"{sid}\n"
        # localhost and the sandbox's own name resolve: a server it starts answers on both
        out = backend.ok(sid, SERVE + "wget -q -O- http://localhost:8089/x; wget -q -O- http://$(hostname):8089/x")
        assert out == "served\nserved\n", out
        # they are the sandbox's own files: root edits them, as in a container
        backend.ok(sid, "echo '10.0.0.9 db' >> /etc/hosts && echo renamed > /etc/hostname")
        assert backend.ok(sid, ["tail", "-n1", "/etc/hosts"]) == "10.0.0.9 db\n"


def test_the_files_are_owned_by_the_sandboxs_root_and_world_readable(backend: BackendHarness,
                                                                      images: dict[str, ImageRef]) -> None:
    with backend.sandbox(spec=backend.spec().model_copy(update={"image": images["no /etc"]})) as rec:
        out = backend.ok(rec.id, "stat -c '%u %g %a %n' /etc /etc/hosts /etc/hostname")
        assert out == "0 0 755 /etc\n0 0 644 /etc/hosts\n0 0 644 /etc/hostname\n", out
        assert f"127.0.1.1\t{rec.id}" in backend.ok(rec.id, ["cat", "/etc/hosts"], user=65534)


def test_two_sandboxes_of_one_image_each_have_their_own(backend: BackendHarness, images: dict[str, ImageRef],
                                                          tmp_path: Path) -> None:
    with backend.sandbox() as a, backend.sandbox() as b:
        assert backend.ok(a.id, ["cat", "/etc/hostname"]) == hostname_text(a.id)
        assert backend.ok(b.id, ["cat", "/etc/hostname"]) == hostname_text(b.id)
        assert a.id not in backend.ok(b.id, ["cat", "/etc/hosts"])
