"""The microVM guest image: a kernel (``vmlinux``) and an initramfs holding the agent.

:func:`ensure_guest` returns :class:`GuestAssets`, making what is missing under a cache
directory, content-addressed:

- ``kernel.json``: the Debian kernel in use (package, the .deb's sha256, release). Once
  written it pins the kernel: later calls never ask apt again (``refresh=True`` does).
- ``debs/<package>.deb``: Debian's cloud kernel from bookworm-backports, the
  ``linux-image-6.*-cloud-amd64`` that ``linux-image-cloud-amd64`` depends on
  (``apt-get download``: nothing is installed on the host).
- ``kernels/<deb sha256[:16]>/``: ``vmlinux`` (cut out of the zstd payload of the
  bzImage: QEMU's microvm boots an uncompressed ELF through its PVH note), ``modules/*.ko``
  (unxz'd) and ``release``.
- ``initrd-<sha256[:16]>.cpio``: an uncompressed newc cpio of ``/init`` (the static agent,
  :mod:`dsec.backends.microvm.build`), ``/lib/modules/*.ko`` and ``/lib/modules/order`` (the
  load order, dependencies first, read from each module's ``depends=``).

Every file is written to a temporary name and renamed, so concurrent callers and a crash
mid-way leave no half file. Operators may bring their own kernel (``kernel=``, used as
is) and initramfs (``initrd=``); a custom kernel without an initramfs gets the agent with
no modules (its drivers must then be built in). Blocking (downloads, decompression): call
from a thread. ``python -m dsec.backends.microvm.guest [cache_dir] [--refresh]`` prepares
the cache (scripts/setup.sh does).
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import HostError, ImageError

DEFAULT_CACHE = Path("/var/lib/dsec/cache/microvm")
META_PACKAGE = "linux-image-cloud-amd64/bookworm-backports"
MODULES: tuple[str, ...] = (
    "virtio_mmio", "virtio_blk", "libcrc32c", "erofs", "overlay",
    "vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport",
    "virtio_rng", "virtio_balloon", "virtio_net", "inet_diag", "tcp_diag",
)
"""Modules the initramfs carries (with their dependencies), loaded in dependency order.
``virtio_console`` and ext4 are built into Debian's cloud kernel."""
OPTIONAL_MODULES = frozenset({"vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport",
                              "virtio_rng", "virtio_balloon", "inet_diag", "tcp_diag"})
TUNE = ("console=hvc0 quiet panic=-1 reboot=t "
        "initcall_blacklist=load_system_certificate_list,jent_mod_init,bpf_tcp_ca_kfunc_init,"
        "bpf_dummy_struct_ops_init,bert_init,init_encrypted,lockup_detector_check,trace_eval_init,"
        "crypto_kdf108_init cryptomgr.notests ipv6.disable=1 audit=0 tsc=reliable mitigations=off init_on_alloc=0")
"""The probe's kernel command line (VM-PROBE.md §1, TUNE): see there for what it trades away."""
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True, slots=True)
class GuestAssets:
    """What QEMU boots: ``-kernel vmlinux -initrd initrd``. ``digest`` (sha256 over both
    files) names the pair in template keys: a new agent or kernel makes new templates."""

    vmlinux: Path
    initrd: Path
    kernel_version: str
    digest: str


def ensure_guest(cache_dir: Path = DEFAULT_CACHE, *, kernel: Path | None = None, initrd: Path | None = None,
                 agent: Path | None = None, refresh: bool = False) -> GuestAssets:
    """The guest image, made under ``cache_dir`` when missing (see the module docstring).
    ``agent``: the agent binary for the initramfs (default: built from source)."""
    cache_dir = Path(cache_dir)
    if kernel is not None:
        kernel = Path(kernel)
        if not kernel.is_file():
            raise ImageError(f"guest kernel {kernel} does not exist", path=str(kernel))
        if initrd is None:
            initrd = _initramfs(cache_dir, _agent(agent), {})
        elif not Path(initrd).is_file():
            raise ImageError(f"guest initramfs {initrd} does not exist", path=str(initrd))
        return GuestAssets(kernel, Path(initrd), _release_of(kernel), _digest(kernel, Path(initrd)))
    kdir = _debian_kernel(cache_dir, refresh=refresh)
    release = (kdir / "release").read_text().strip()
    if initrd is None:
        modules = {p.stem: p for p in sorted((kdir / "modules").glob("*.ko"))}
        initrd = _initramfs(cache_dir, _agent(agent), modules)
    elif not Path(initrd).is_file():
        raise ImageError(f"guest initramfs {initrd} does not exist", path=str(initrd))
    vmlinux = kdir / "vmlinux"
    return GuestAssets(vmlinux, Path(initrd), release, _digest(vmlinux, Path(initrd)))


def host_tsc_khz() -> int | None:
    """The host's TSC frequency in kHz (from /proc/cpuinfo), or None when unknown.

    Under TCG the guest reads the host's TSC. Its kernel calibrates the TSC against the
    PIT, and on a loaded host that calibration fails about one boot in four ("tsc: Unable
    to calibrate against PIT"; the kernel then hangs at boot with the CPU idle). Passing
    ``tsc_early_khz=`` skips the calibration: 12 of 12 boots where 4 of 10 hung before."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return round(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def kernel_cmdline(*extra: str) -> str:
    """TUNE, ``tsc_early_khz=`` (when known) and ``extra`` (e.g. ``dsec.pids=512``)."""
    khz = host_tsc_khz()
    return " ".join([TUNE, *([f"tsc_early_khz={khz}"] if khz else []), *extra])


# ---------------------------------------------------------------- the kernel ----


def _kernel_dir(cache_dir: Path, deb_sha: str) -> Path:
    """Named by the package and the module list: a new MODULES extracts the package again."""
    mods = hashlib.sha256("\n".join(MODULES).encode()).hexdigest()[:8]
    return cache_dir / "kernels" / f"{deb_sha[:16]}-{mods}"


def _debian_kernel(cache_dir: Path, *, refresh: bool) -> Path:
    """The extracted kernel directory, downloading and extracting when needed."""
    meta_path = cache_dir / "kernel.json"
    if not refresh and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            kdir = _kernel_dir(cache_dir, str(meta["deb"]))
            if (kdir / "vmlinux").is_file() and (kdir / "release").is_file():
                return kdir
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: made again below
    cache_dir.mkdir(parents=True, exist_ok=True)
    package = _kernel_package()
    deb = _download(package, cache_dir / "debs")
    sha = _sha256(deb)
    kdir = _kernel_dir(cache_dir, sha)
    if not (kdir / "vmlinux").is_file():
        _extract(deb, kdir)
    release = (kdir / "release").read_text().strip()
    _atomic_write(meta_path, json.dumps({"package": package, "deb": sha, "release": release}, indent=1).encode())
    return kdir


def _run(cmd: list[str], what: str, hint: str, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=600)
    except FileNotFoundError:
        raise HostError(f"{what}: {cmd[0]} is not installed ({hint})", command=" ".join(cmd)) from None
    except subprocess.TimeoutExpired:
        raise HostError(f"{what}: timed out", command=" ".join(cmd)) from None
    if proc.returncode != 0:
        raise HostError(f"{what} failed ({hint}): {proc.stderr.strip()[-500:]}", command=" ".join(cmd))
    return proc.stdout


def _kernel_package() -> str:
    out = _run(["apt-cache", "depends", META_PACKAGE], "looking up the guest kernel",
               "enable bookworm-backports (scripts/setup.sh does) and run apt-get update")
    m = re.search(r"Depends:\s*(linux-image-6\.\S*-cloud-amd64)", out)
    if not m:
        raise HostError(f"{META_PACKAGE} depends on no linux-image-6.*-cloud-amd64 package:\n{out.strip()}")
    return m.group(1)


def _download(package: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    have = sorted(dest.glob(f"{package}_*.deb"))
    if have:
        return have[-1]
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        # apt drops privileges to _apt, which cannot write a root-only directory
        os.chmod(tmp, 0o755)
        _run(["apt-get", "download", "-q", package], f"downloading {package}",
             "needs network access to deb.debian.org and bookworm-backports in apt's sources", cwd=Path(tmp))
        debs = list(Path(tmp).glob("*.deb"))
        if len(debs) != 1:
            raise HostError(f"apt-get download {package} left {len(debs)} .deb files")
        out = dest / debs[0].name
        os.replace(debs[0], out)
    return out


def _extract(deb: Path, kdir: Path) -> None:
    """vmlinux, the modules' .ko files (MODULES and their dependencies) and the release."""
    vmlinuz: bytes | None = None
    release = ""
    found: dict[str, bytes] = {}  # module name -> .ko.xz bytes (every module of the package)
    with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for m in tar:
                name = m.name.removeprefix("./")
                if not m.isfile():
                    continue
                if name.startswith("boot/vmlinuz-"):
                    release = name.removeprefix("boot/vmlinuz-")
                    f = tar.extractfile(m)
                    vmlinuz = f.read() if f else None
                elif name.startswith("lib/modules/") and name.endswith(".ko.xz"):
                    f = tar.extractfile(m)
                    if f:
                        found[Path(name).name.removesuffix(".ko.xz").replace("-", "_")] = f.read()
        err = proc.stderr.read() if proc.stderr else b""
    if proc.returncode != 0:
        raise ImageError(f"dpkg-deb --fsys-tarfile {deb} failed: {err.decode(errors='replace')[-300:]}")
    if vmlinuz is None or not release:
        raise ImageError(f"{deb.name} holds no boot/vmlinuz-*: not a kernel package?")
    kdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=kdir.parent, prefix=".kernel-"))
    os.chmod(tmp, 0o755)
    try:
        (tmp / "vmlinux").write_bytes(vmlinux_from_bzimage(vmlinuz))
        (tmp / "modules").mkdir()
        kos = {n: lzma.decompress(found[n]) for n in _closure(MODULES, found)}
        for n, data in kos.items():
            (tmp / "modules" / f"{n}.ko").write_bytes(data)
        (tmp / "release").write_text(release + "\n")
        try:
            os.rename(tmp, kdir)
        except OSError:
            if not (kdir / "vmlinux").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _closure(names: Iterable[str], found: Mapping[str, bytes]) -> list[str]:
    """``names`` and what they depend on, among the package's modules."""
    out: set[str] = set()
    todo = list(names)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        if n not in found:
            if n in OPTIONAL_MODULES:
                continue
            raise ImageError(f"the kernel package has no module {n} (built in? then drop it from MODULES)")
        out.add(n)
        todo += module_depends(lzma.decompress(found[n]))
    return sorted(out)


def module_depends(ko: bytes) -> list[str]:
    """The ``depends=`` of a module's .modinfo (what ``modinfo -F depends`` prints)."""
    m = re.search(rb"(?:^|\0)depends=([^\0]*)\0", ko)
    if not m or not m.group(1):
        return []
    return [d.decode().replace("-", "_") for d in m.group(1).split(b",") if d]


def vmlinux_from_bzimage(bzimage: bytes) -> bytes:
    """The ELF kernel inside a zstd-compressed bzImage (the first zstd frame that decodes
    to an ELF file; trailing bytes after the frame are ignored)."""
    import zstandard

    start = 0
    while (off := bzimage.find(ZSTD_MAGIC, start)) >= 0:
        start = off + 1
        try:
            out = zstandard.ZstdDecompressor().decompressobj().decompress(bzimage[off:])
        except zstandard.ZstdError:
            continue
        if out.startswith(ELF_MAGIC):
            return out
    raise ImageError("no zstd-compressed ELF kernel in the bzImage (compressed another way? "
                     "pass kernel= with an uncompressed vmlinux)")


def _release_of(kernel: Path) -> str:
    """A custom kernel's release string when it carries one ("Linux version X ..."), else its name."""
    with open(kernel, "rb") as f:
        head = f.read(64 * 1024 * 1024)
    m = re.search(rb"Linux version (\S+)", head)
    return m.group(1).decode(errors="replace") if m else kernel.name


# ---------------------------------------------------------------- the initramfs ----


def _agent(agent: Path | None) -> Path:
    if agent is not None:
        return Path(agent)
    from dsec.backends.microvm.build import agent_path

    path: Path = agent_path()
    return path


def module_order(modules: Mapping[str, Path]) -> list[str]:
    """The modules in load order: each after everything in its ``depends=``."""
    deps = {n: [d for d in module_depends(p.read_bytes()) if d in modules] for n, p in modules.items()}
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(n: str) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            raise ImageError(f"module dependency cycle through {n}")
        state[n] = 1
        for d in sorted(deps[n]):
            visit(d)
        state[n] = 2
        order.append(n)

    rank = {n: i for i, n in enumerate(MODULES)}
    for n in sorted(modules, key=lambda m: (rank.get(m, len(rank)), m)):
        visit(n)
    return order


def _initramfs(cache_dir: Path, agent: Path, modules: Mapping[str, Path]) -> Path:
    if not agent.is_file():
        raise HostError(f"the guest agent {agent} does not exist (python -m dsec.backends.microvm.build)")
    order = module_order(modules)
    files: list[tuple[str, int, bytes]] = [("init", 0o100755, agent.read_bytes())]
    files += [(f"lib/modules/{n}.ko", 0o100644, modules[n].read_bytes()) for n in order]
    files.append(("lib/modules/order", 0o100644, "".join(f"{n}\n" for n in order).encode()))
    data = cpio_newc(files, dirs=("dev", "proc", "sys", "lib", "lib/modules", "sysroot", "layers", "upper", "tmp"),
                     chardevs=(("dev/console", 0o020600, 5, 1),))
    out = cache_dir / f"initrd-{hashlib.sha256(data).hexdigest()[:16]}.cpio"
    if not out.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(out, data)
    return out


def cpio_newc(files: Iterable[tuple[str, int, bytes]], *, dirs: Iterable[str] = (),
              chardevs: Iterable[tuple[str, int, int, int]] = ()) -> bytes:
    """An uncompressed "newc" cpio archive (what the kernel unpacks as the initramfs).
    Deterministic: mtimes 0, owners root, inode numbers in order."""
    buf = io.BytesIO()
    ino = 0

    def entry(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0), nlink: int = 1) -> None:
        nonlocal ino
        ino += 1
        raw = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(raw), 0)
        buf.write(b"070701" + b"".join(b"%08X" % f for f in fields) + raw)
        buf.write(b"\0" * (-buf.tell() % 4))
        buf.write(data)
        buf.write(b"\0" * (-buf.tell() % 4))

    entry(".", 0o040755, nlink=2)
    for d in dirs:
        entry(d, 0o040755, nlink=2)
    for name, mode, major, minor in chardevs:
        entry(name, mode, rdev=(major, minor))
    for name, mode, data in files:
        entry(name, mode, data)
    entry("TRAILER!!!", 0)
    return buf.getvalue()


# ---------------------------------------------------------------- helpers ----


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digest(vmlinux: Path, initrd: Path) -> str:
    h = hashlib.sha256()
    for p in (vmlinux, initrd):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    cache = Path(args[0]) if args else DEFAULT_CACHE
    try:
        g = ensure_guest(cache, refresh="--refresh" in argv)
    except (HostError, ImageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"microvm guest: kernel {g.kernel_version}\n  vmlinux {g.vmlinux}\n  initrd  {g.initrd}\n  digest  {g.digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
