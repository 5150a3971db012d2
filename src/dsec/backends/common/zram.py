"""Compressed swap in RAM (zram) for paused sandboxes: set up, reuse, tear down.

A paused sandbox's memory is pushed out to swap (:mod:`.pause`). With a zram
device as the swap, those pages stay in RAM compressed (lz4 here: text-like
data shrinks 20-50x, random data not at all), so the host gets back most of
what idle sandboxes held without touching a disk.

The device is DSec's by two marks: a record ``<run_dir>/zram.json`` (device
number, size) written *before* the device is configured, and the swap label
``dsec-<8 hex>`` (a hash of the runtime's name) in the swap header. A runtime
that restarts after a crash finds its device by them and reuses it — paused
sandboxes may have pages in it — and :meth:`ZramSwap.teardown` removes it.
Devices without our label (``zram0`` made by the kernel at boot, another
tool's) are never touched.

Only this module writes under /sys/block/zram*, /sys/class/zram-control and
calls swapon/swapoff. It never swaps off a device on its own: swapoff pulls
every page back into RAM, so the caller decides (the runtime does it on
``close()`` when no sandbox is left).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dsec.errors import HostError, InvalidSpec

log = logging.getLogger("dsec.zram")

SYS_BLOCK: Final = Path("/sys/block")
ZRAM_CONTROL: Final = Path("/sys/class/zram-control")
PAGE: Final = os.sysconf("SC_PAGE_SIZE")
SWAP_MAGIC: Final = b"SWAPSPACE2"
SWAP_FLAG_PREFER: Final = 0x8000
SWAP_FLAG_PRIO_MASK: Final = 0x7FFF
MIN_SIZE: Final = 16 * 1024 * 1024
PREFERRED_ALGORITHMS: Final = ("lz4", "lzo-rle", "lzo", "zstd")
"""lz4 first: it compresses ~3x faster than zstd and page-in speed is what resume waits for."""

_libc = ctypes.CDLL(None, use_errno=True)


def swap_label(name: str) -> str:
    """The swap label of runtime ``name``'s device (labels hold at most 16 bytes)."""
    return "dsec-" + hashlib.sha256(name.encode()).hexdigest()[:8]


@dataclass(frozen=True, slots=True)
class ZramStats:
    device: str
    disksize: int
    """Bytes of swap the device offers."""
    orig_data_size: int
    """Bytes of pages stored (before compression)."""
    compr_data_size: int
    mem_used_total: int
    """RAM the device uses now, allocator overhead included: what pausing costs the host."""
    algorithm: str


def active_swaps() -> dict[str, int]:
    """Active swap areas: path -> bytes used (from /proc/swaps)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/swaps").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 4:
                out[parts[0]] = int(parts[3]) * 1024
    return out


def _swap_header(size: int, label: str) -> bytes:
    """Page 0 of a swap area (what mkswap writes): v1 header, label, magic."""
    pages = size // PAGE
    hdr = bytearray(PAGE)
    off = 1024
    hdr[off : off + 4] = (1).to_bytes(4, "little")  # version
    hdr[off + 4 : off + 8] = (pages - 1).to_bytes(4, "little")  # last_page
    hdr[off + 8 : off + 12] = (0).to_bytes(4, "little")  # nr_badpages
    hdr[off + 12 : off + 28] = uuid.uuid4().bytes
    lab = label.encode()[:16]
    hdr[off + 28 : off + 28 + len(lab)] = lab
    hdr[PAGE - len(SWAP_MAGIC) :] = SWAP_MAGIC
    return bytes(hdr)


def read_label(dev: Path) -> str | None:
    """The label of the swap area on ``dev``, or None if it holds none."""
    try:
        fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        page = os.pread(fd, PAGE, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(page) < PAGE or page[PAGE - len(SWAP_MAGIC) :] != SWAP_MAGIC:
        return None
    return page[1052:1068].split(b"\0", 1)[0].decode(errors="replace")


class ZramSwap:
    """One zram swap device owned by one runtime. Not thread-safe; cheap to construct."""

    def __init__(self, name: str, size: int, record: Path, *, priority: int = 100, algorithm: str | None = None) -> None:
        if size and size < MIN_SIZE:
            raise InvalidSpec(f"zram size must be 0 (none) or at least {MIN_SIZE} bytes", field="zram_size")
        if not 0 <= priority <= SWAP_FLAG_PRIO_MASK:
            raise InvalidSpec("swap priority must be within 0..32767", field="priority")
        self.name = name
        self.size = size - size % PAGE
        self.record = record
        self.priority = priority
        self.algorithm = algorithm
        self.label = swap_label(name)
        self.device: int | None = None

    # ----- finding our device -----

    @staticmethod
    def _dev(n: int) -> Path:
        return Path(f"/dev/zram{n}")

    @staticmethod
    def _sys(n: int) -> Path:
        return SYS_BLOCK / f"zram{n}"

    def _recorded(self) -> int | None:
        try:
            data = json.loads(self.record.read_text())
            n = int(data["device"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return n if self._sys(n).is_dir() else None

    def find(self) -> int | None:
        """Our device: the recorded one, else an active swap carrying our label."""
        n = self._recorded()
        if n is not None:
            dev = self._dev(n)
            # Recorded but swapping with another label: the number was reused by someone else.
            if str(dev) not in active_swaps() or read_label(dev) == self.label:
                return n
            self.record.unlink(missing_ok=True)
        for path in active_swaps():
            name = os.path.basename(path)
            if name.startswith("zram") and name[4:].isdigit() and read_label(Path(path)) == self.label:
                return int(name[4:])
        return None

    def active(self) -> bool:
        return self.device is not None and str(self._dev(self.device)) in active_swaps()

    # ----- set up -----

    def ensure(self) -> int:
        """Make sure our zram swap is on; reuse the device of an earlier run. Returns its number."""
        if self.size <= 0:
            raise InvalidSpec("zram size is 0: nothing to set up", field="zram_size")
        found = self.find()
        if found is not None:
            self.device = found
            if str(self._dev(found)) in active_swaps():
                have = int(self._read(found, "disksize") or 0)
                if have != self.size:
                    log.info("reusing zram%d of %d bytes (asked %d; resized when no sandbox is paused)", found, have, self.size)
                self._write_record(found)
                return found
            # Recorded but not (or no longer) our active swap: configure it afresh.
            try:
                self._reset(found)
                self._configure(found)
            except BaseException:
                self._remove_device(found)
                raise
            return found
        n = self._hot_add()
        self.device = n
        try:
            self._write_record(n)
            self._configure(n)
        except BaseException:
            self._remove_device(n)
            raise
        log.info("zram swap zram%d: %d MiB, %s", n, self.size >> 20, self._algorithm_in_use(n))
        return n

    def _hot_add(self) -> int:
        if not ZRAM_CONTROL.is_dir():
            modprobe = shutil.which("modprobe")
            if modprobe is not None:
                subprocess.run([modprobe, "zram", "num_devices=0"], capture_output=True, check=False)
        if not ZRAM_CONTROL.is_dir():
            raise HostError(
                "zram is not available: the kernel needs CONFIG_ZRAM (load it with `modprobe zram`)",
                feature="zram",
            )
        try:
            return int((ZRAM_CONTROL / "hot_add").read_text().strip())
        except (OSError, ValueError) as exc:
            raise HostError(f"cannot add a zram device: {exc}", feature="zram") from exc

    def _write_record(self, n: int) -> None:
        self.record.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"device": n, "size": self.size, "label": self.label, "name": self.name,
                                   "at": time.time()}))
        os.replace(tmp, self.record)

    def _read(self, n: int, attr: str) -> str:
        try:
            return (self._sys(n) / attr).read_text().strip()
        except OSError:
            return ""

    def _set(self, n: int, attr: str, value: str) -> None:
        fd = os.open(self._sys(n) / attr, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def _algorithm_in_use(self, n: int) -> str:
        text = self._read(n, "comp_algorithm")
        for word in text.split():
            if word.startswith("["):
                return word.strip("[]")
        return text

    def _configure(self, n: int) -> None:
        offered = [w.strip("[]") for w in self._read(n, "comp_algorithm").split()]
        wanted = [self.algorithm] if self.algorithm else list(PREFERRED_ALGORITHMS)
        for alg in wanted:
            if alg in offered:
                self._set(n, "comp_algorithm", alg)
                break
        else:
            if self.algorithm:
                raise InvalidSpec(f"zram algorithm {self.algorithm!r} is not offered (have {', '.join(offered)})",
                                  field="algorithm")
        try:
            self._set(n, "disksize", str(self.size))
        except OSError as exc:
            raise HostError(f"cannot size zram{n} to {self.size} bytes: {exc.strerror}", feature="zram") from exc
        dev = self._ensure_node(n)
        fd = os.open(dev, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, _swap_header(self.size, self.label), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        if _libc.swapon(os.fsencode(dev), SWAP_FLAG_PREFER | (self.priority & SWAP_FLAG_PRIO_MASK)) != 0:
            err = ctypes.get_errno()
            raise HostError(f"swapon {dev} failed: {os.strerror(err)} (needs root and CONFIG_SWAP)",
                            feature="swap", errno=err)

    def _ensure_node(self, n: int) -> Path:
        """/dev/zramN (devtmpfs makes it; a static /dev may not)."""
        dev = self._dev(n)
        if not dev.exists():
            major, minor = (int(x) for x in self._read(n, "dev").split(":"))
            os.mknod(dev, 0o600 | stat.S_IFBLK, os.makedev(major, minor))
        return dev

    # ----- tear down -----

    def _reset(self, n: int) -> None:
        dev = self._dev(n)
        if str(dev) in active_swaps() and _libc.swapoff(os.fsencode(dev)) != 0:
            err = ctypes.get_errno()
            raise HostError(
                f"swapoff {dev} failed: {os.strerror(err)}"
                + (" (not enough free RAM to take the swapped pages back)" if err == errno.ENOMEM else ""),
                feature="swap", errno=err,
            )
        for _ in range(50):
            try:
                self._set(n, "reset", "1")
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise HostError(f"cannot reset zram{n}: {exc.strerror}", feature="zram") from exc
                time.sleep(0.02)  # the block device is still open somewhere (udev probing)
        raise HostError(f"cannot reset zram{n}: device busy", feature="zram")

    def _remove_device(self, n: int) -> None:
        with contextlib.suppress(HostError, OSError):
            self._reset(n)
        for _ in range(50):
            try:
                (ZRAM_CONTROL / "hot_remove").write_text(str(n))
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    break
                time.sleep(0.02)
        self.record.unlink(missing_ok=True)
        self.device = None

    def teardown(self) -> bool:
        """Swap off and remove our device (and its record). False if there was none.

        swapoff brings every swapped page back into RAM first: call this when no
        paused sandbox is left."""
        n = self.find() if self.device is None else self.device
        if n is None or not self._sys(n).is_dir():
            self.record.unlink(missing_ok=True)
            self.device = None
            return False
        self._reset(n)
        self._remove_device(n)
        return True

    # ----- figures -----

    def stats(self) -> ZramStats | None:
        n = self.device
        if n is None:
            return None
        mm = self._read(n, "mm_stat").split()
        vals = [int(x) for x in mm[:3]] if len(mm) >= 3 else [0, 0, 0]
        return ZramStats(
            device=str(self._dev(n)), disksize=int(self._read(n, "disksize") or 0), orig_data_size=vals[0],
            compr_data_size=vals[1], mem_used_total=vals[2], algorithm=self._algorithm_in_use(n),
        )


__all__ = ["ZramStats", "ZramSwap", "active_swaps", "read_label", "swap_label"]
