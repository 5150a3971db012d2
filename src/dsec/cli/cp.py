"""``dsec cp``: files and directories between here and a sandbox, with ``docker cp``'s rules.

- ``SRC`` a directory: copied *into* ``DEST`` when ``DEST`` is an existing directory
  (``DEST/basename``), else ``DEST`` is made with its contents; ``SRC/.`` copies the
  contents into ``DEST``.
- ``SRC`` a file (or a symlink, copied as one): onto an existing directory it goes inside
  (``DEST/basename``), else it is written as ``DEST``; ``DEST`` ending in ``/`` must be an
  existing directory.
- ``-`` as ``DEST`` writes a tar of ``SRC`` to stdout (entries named ``basename/...``);
  ``-`` as ``SRC`` reads a tar from stdin into the directory ``DEST``.
- A path in a sandbox is ``ID:/absolute/path``; a local path with a ``:`` in its first
  component is written ``./name``.

Files and symlinks at the destination are replaced, directories merged; a directory is never
replaced by a file nor a file by a directory: that is refused before anything is written.
Copies into a sandbox travel as one tar (the edge checks every member before writing any).
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import stat
import sys
import tarfile
from typing import Any

import click

from dsec.errors import FileAccessError


def parse(arg: str) -> tuple[str | None, str]:
    """``ID:/path`` -> (ID, /path); a local path (or ``-``) -> (None, path)."""
    head, sep, rest = arg.partition(":")
    if not sep or not head or "/" in head or head.startswith("."):
        return None, arg
    if not rest.startswith("/"):
        raise click.UsageError(f"{arg!r}: a path in a sandbox must be absolute ({head}:/{rest})")
    return head, rest


def copy(client: Any, src: str, dst: str) -> None:
    sid_src, src_path = parse(src)
    sid_dst, dst_path = parse(dst)
    if sid_src and sid_dst:
        raise click.UsageError("both SRC and DEST are in sandboxes: copy out to here, then in")
    if not sid_src and not sid_dst:
        raise click.UsageError("one of SRC and DEST must be a sandbox path, ID:/path")
    if sid_dst:
        copy_in(client.connect(sid_dst), src_path, dst_path)
    else:
        assert sid_src is not None
        copy_out(client.connect(sid_src), src_path, dst_path)


def _remote_stat(sb: Any, path: str) -> dict[str, Any] | None:
    try:
        st: dict[str, Any] = sb.files.stat(path)
        return st
    except FileAccessError as exc:
        if exc.fields.get("errno") in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise


def _contents_only(path: str) -> bool:
    return path.endswith("/.") or path == "."


def _base(path: str) -> str:
    return posixpath.basename(posixpath.normpath(path.rstrip("/")) if path.rstrip("/") else "/")


# ------------------------------------------------------------------ into a sandbox --


def copy_in(sb: Any, local: str, dest: str) -> None:
    if local == "-":
        st = _remote_stat(sb, dest)
        if st is None or st["type"] != "dir":
            raise click.ClickException(f"{sb.id}:{dest}: the destination of a tar from stdin must be an existing directory")
        sb.files.upload(dest, sys.stdin.buffer.read())
        return
    try:
        lst = os.lstat(local)
    except OSError as exc:
        raise click.ClickException(f"{local}: {exc.strerror.lower() if exc.strerror else exc}") from None
    dest_st = _remote_stat(sb, dest)
    is_dir = stat.S_ISDIR(lst.st_mode)
    if dest.endswith("/") and dest_st is not None and dest_st["type"] != "dir":
        raise click.ClickException(f"{sb.id}:{dest} is not a directory")
    if dest_st is None:
        if dest.endswith("/") and not is_dir:
            raise click.ClickException(f"{sb.id}:{dest} does not exist, and a path ending in / must be a directory")
        parent = posixpath.dirname(dest.rstrip("/")) or "/"
        pst = _remote_stat(sb, parent)
        if pst is None or pst["type"] != "dir":
            raise click.ClickException(f"{sb.id}:{parent} is not a directory: make it first")
        target = dest.rstrip("/") or "/"
    elif dest_st["type"] == "dir":
        target = dest if is_dir and _contents_only(local) else posixpath.join(dest, _base(local))
    elif is_dir:
        raise click.ClickException(f"cannot copy directory {local} onto {sb.id}:{dest}, which is not a directory")
    else:
        target = dest
    if is_dir:
        there = _remote_stat(sb, target) if target != dest else dest_st
        if there is not None and there["type"] != "dir":
            raise click.ClickException(f"cannot overwrite non-directory {sb.id}:{target} with directory {local}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(local, arcname=".")
        sb.files.upload(target, buf.getvalue())
        return
    there = _remote_stat(sb, target) if target != dest else dest_st
    if there is not None and there["type"] == "dir":
        raise click.ClickException(f"cannot overwrite directory {sb.id}:{target} with non-directory {local}")
    # One member in a tar, so that a file or symlink at the target is replaced (not written through).
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(local, arcname=posixpath.basename(target), recursive=False)
    sb.files.upload(posixpath.dirname(target) or "/", buf.getvalue())


# ------------------------------------------------------------------ out of a sandbox --


def _member(name: str, st: dict[str, Any], *, kind: bytes, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = int(st.get("mode", 0o644)) & 0o7777
    info.mtime = int(st.get("mtime", 0))
    info.uid, info.gid = int(st.get("uid", 0)), int(st.get("gid", 0))
    info.size = size
    info.linkname = link
    return info


def _tar_of(sb: Any, src: str, st: dict[str, Any], top: str | None) -> bytes:
    """A tar of ``src`` whose entries are named ``top/...`` (``top`` None: the entries of a directory as they are)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as out:
        if st["type"] == "dir":
            if top is not None:
                out.addfile(_member(top, st, kind=tarfile.DIRTYPE))
            with tarfile.open(fileobj=io.BytesIO(sb.files.download(src))) as tar:
                for m in tar:
                    f = tar.extractfile(m) if m.isreg() else None
                    if top is not None:
                        m.name = posixpath.join(top, m.name)
                    out.addfile(m, f)
        elif st["type"] == "symlink":
            out.addfile(_member(top or _base(src), st, kind=tarfile.SYMTYPE, link=str(st.get("target") or "")))
        else:
            data = sb.files.read(src)
            out.addfile(_member(top or _base(src), st, kind=tarfile.REGTYPE, size=len(data)), io.BytesIO(data))
    return buf.getvalue()


def _safe(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """tarfile's "tar" filter (nothing lands outside the destination, through a symlink either),
    and no device or other special file."""
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise tarfile.FilterError(f"{member.name!r} is a special file: not copied")
    return tarfile.tar_filter(member, path)


def copy_out(sb: Any, src: str, local: str) -> None:
    st = _remote_stat(sb, src)
    if st is None:
        raise click.ClickException(f"{sb.id}:{src}: no such file or directory")
    contents = st["type"] == "dir" and _contents_only(src)
    if local.endswith("/") and os.path.exists(local) and not os.path.isdir(local):
        raise click.ClickException(f"{local} is not a directory")
    if local == "-":
        sys.stdout.buffer.write(_tar_of(sb, src, st, None if contents else _base(src)))
        sys.stdout.buffer.flush()
        return
    try:
        lst: os.stat_result | None = os.stat(local)
    except FileNotFoundError:
        lst = None
    if lst is None:
        if local.endswith("/") and st["type"] != "dir":
            raise click.ClickException(f"{local} does not exist, and a path ending in / must be a directory")
        parent = os.path.dirname(local.rstrip("/")) or "."
        if not os.path.isdir(parent):
            raise click.ClickException(f"{parent} is not a directory: make it first")
        target = local.rstrip("/") or "/"
    elif stat.S_ISDIR(lst.st_mode):
        target = local if contents else os.path.join(local, _base(src))
    elif st["type"] == "dir":
        raise click.ClickException(f"cannot copy directory {sb.id}:{src} onto {local}, which is not a directory")
    else:
        target = local
    if st["type"] == "dir":
        if os.path.lexists(target) and not os.path.isdir(target):
            raise click.ClickException(f"cannot overwrite non-directory {target} with directory {sb.id}:{src}")
        os.makedirs(target, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(sb.files.download(src))) as tar:
            tar.extractall(target, filter=_safe)
        return
    if os.path.isdir(target) and not os.path.islink(target):
        raise click.ClickException(f"cannot overwrite directory {target} with non-directory {sb.id}:{src}")
    with tarfile.open(fileobj=io.BytesIO(_tar_of(sb, src, st, os.path.basename(target)))) as tar:
        if os.path.lexists(target):
            os.unlink(target)  # a file or symlink is replaced, not written through
        tar.extractall(os.path.dirname(os.path.abspath(target)), filter=_safe)
