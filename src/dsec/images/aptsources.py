"""apt's own sources, read as apt reads them, and the Debian mirror they name.

Owns: parsing ``/etc/apt/sources.list`` and ``sources.list.d/*.list`` (one-line format) and
``sources.list.d/*.sources`` (deb822), and choosing the mirror for a suite. Never names a
mirror host of its own: a machine may reach Debian only through the mirror its apt
configuration names (its own, a proxy, a snapshot).

The standard library only, and no import of the ``dsec`` package: the shell scripts that
set a machine up run it by path before any virtualenv exists (``scripts/setup.sh`` and
``deploy/image.sh`` write bookworm-backports' sources with it)::

    python3 src/dsec/images/aptsources.py mirror bookworm        # the archive mirror apt uses
    python3 src/dsec/images/aptsources.py stanza bookworm-backports > /etc/apt/sources.list.d/x.sources

The debootstrap builder (``debootstrap.find_mirror``) uses the same choice.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ETC_APT = Path("/etc/apt")
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
"""The keyring a stanza names when the chosen source names none (apt's default trust)."""
_SCHEMES = ("http", "https", "ftp", "file")


@dataclass(frozen=True)
class AptSource:
    """One ``deb`` line (or deb822 stanza expanded to one URI)."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None = None
    origin: str = ""


def one_line_sources(text: str, origin: str) -> Iterator[AptSource]:
    """The ``deb`` lines of a ``sources.list``-format text (``deb-src`` and comments skipped)."""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        options: dict[str, str] = {}
        m = re.match(r"^(\S+)\s+\[([^\]]*)\]\s+(.*)$", line)
        if m:
            kind, opts, rest = m.groups()
            for opt in opts.split():
                k, _, v = opt.partition("=")
                options[k.lower()] = v
        else:
            kind, _, rest = line.partition(" ")
        if kind != "deb":
            continue
        cdrom = re.match(r"^(cdrom:\[[^\]]*\]\S*)\s+(.*)$", rest.strip())  # a disc's label has spaces
        words = [cdrom.group(1), *cdrom.group(2).split()] if cdrom else rest.split()
        if len(words) < 2:
            continue
        yield AptSource(uri=words[0], suites=(words[1],), components=tuple(words[2:]),
                        signed_by=options.get("signed-by"), origin=origin)


def deb822_sources(text: str, origin: str) -> Iterator[AptSource]:
    """The enabled ``Types: deb`` stanzas of a ``.sources`` text, one per URI."""
    stanzas: list[dict[str, str]] = [{}]
    key: str | None = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if stanzas[-1]:
                stanzas.append({})
            key = None
            continue
        if raw[0] in " \t" and key is not None:
            stanzas[-1][key] += "\n" + raw.strip()
            continue
        k, sep, v = raw.partition(":")
        if not sep:
            continue
        key = k.strip().lower()
        stanzas[-1][key] = v.strip()
    for st in stanzas:
        if not st or st.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in st.get("types", "").split():
            continue
        signed = st.get("signed-by", "").strip()
        keyring = signed if signed.startswith("/") and "\n" not in signed else None
        for uri in st.get("uris", "").split():
            yield AptSource(uri=uri, suites=tuple(st.get("suites", "").split()),
                            components=tuple(st.get("components", "").split()), signed_by=keyring, origin=origin)


def apt_sources(etc_apt: Path = ETC_APT) -> list[AptSource]:
    """Every enabled ``deb`` source, in apt's own order (files apt ignores are ignored)."""
    out: list[AptSource] = []
    main = etc_apt / "sources.list"
    if main.is_file():
        out.extend(one_line_sources(main.read_text(errors="replace"), str(main)))
    d = etc_apt / "sources.list.d"
    if d.is_dir():
        for f in sorted(d.iterdir()):
            if f.suffix == ".list" and f.is_file():
                out.extend(one_line_sources(f.read_text(errors="replace"), str(f)))
            elif f.suffix == ".sources" and f.is_file():
                out.extend(deb822_sources(f.read_text(errors="replace"), str(f)))
    return out


def pick_source(suite: str, sources: Sequence[AptSource]) -> AptSource | None:
    """The source apt would fetch ``suite``'s ``main`` from, or the host's Debian archive mirror:

    1. one that carries ``suite`` itself;
    2. one that carries its release (``bookworm`` for ``bookworm-backports``): the archive
       mirror, which carries the release's other suites too;
    3. any that carries a plain release suite (no ``-security``/``-updates``), as a full
       archive mirror does.

    Only ``main``, and only http(s), ftp and file URIs (not ``cdrom:``); in apt's order within
    each rank. None when apt's sources name no such mirror."""
    usable = [s for s in sources if s.uri.split(":", 1)[0] in _SCHEMES and "main" in s.components]
    release = suite.split("-", 1)[0]
    ranked = ([s for s in usable if suite in s.suites] + [s for s in usable if release in s.suites]
              + [s for s in usable if any("-" not in x for x in s.suites)])
    return ranked[0] if ranked else None


def where(etc_apt: Path) -> str:
    """The files apt reads, for a message."""
    return f"{etc_apt}/sources.list, {etc_apt}/sources.list.d/*.list and *.sources"


def stanza(suite: str, source: AptSource) -> str:
    """A deb822 stanza for ``suite``'s ``main`` from ``source``'s mirror, signed by the keyring
    that source names (else Debian's archive keyring)."""
    return (f"Types: deb\nURIs: {source.uri.rstrip('/')}\nSuites: {suite}\nComponents: main\n"
            f"Signed-By: {source.signed_by or DEBIAN_KEYRING}\n")


USAGE = """usage: aptsources.py [--etc-apt DIR] mirror SUITE | stanza SUITE
  mirror SUITE   the mirror URI apt uses for SUITE (or the host's Debian archive mirror)
  stanza SUITE   a deb822 sources stanza for SUITE's main from that mirror"""


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    etc_apt = ETC_APT
    if args[:1] == ["--etc-apt"] and len(args) >= 2:
        etc_apt, args = Path(args[1]), args[2:]
    if len(args) != 2 or args[0] not in ("mirror", "stanza") or not re.match(r"^[a-z0-9][a-z0-9.-]*$", args[1]):
        print(USAGE, file=sys.stderr)
        return 2
    what, suite = args
    source = pick_source(suite, apt_sources(etc_apt))
    if source is None:
        print(f"aptsources: no Debian mirror for {suite!r} in apt's sources ({where(etc_apt)}): add the mirror "
              "this machine uses there (a deb line or a deb822 stanza with Components: main)", file=sys.stderr)
        return 1
    sys.stdout.write(source.uri.rstrip("/") + "\n" if what == "mirror" else stanza(suite, source))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
