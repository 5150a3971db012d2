"""Uid slots (the container backend's): each sandbox's host uid range is claimed by a file in the
node-wide ``run_dir/uid-slots``, written whole and then linked into place, so a claim is never
seen half written; what a claimer killed mid-claim can leave is its staging file, named after
its pid, which the next start of any runtime removes (a live claimer's stays).

Moved here from tests/conformance: slots are the container backend's, not the protocol's."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable

import pytest

from conftest import RuntimeHarness

pytestmark = pytest.mark.root


def test_a_uid_slot_claim_is_never_seen_half_written_and_a_dead_claimers_staging_file_goes(
        make_runtime: Callable[[str], RuntimeHarness]) -> None:
    # An edge killed between creating and writing a slot file used to leave an empty file no
    # reconcile could attribute (found by the cluster suite: a SIGKILLed edge with a burst of
    # creates in flight).
    h = make_runtime("uidslot").prepare()
    slots = h.run_dir / "uid-slots"
    slots.mkdir(parents=True, exist_ok=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = slots / f".claim-{gone.pid}-cf-{secrets.token_hex(5)}"
    dead.write_text("")
    live = slots / f".claim-{os.getpid()}-cf-{secrets.token_hex(5)}"  # a claim under way elsewhere
    live.write_text("")
    try:
        h.start()
        assert not dead.exists() and live.exists()
        sb = h.create()
        rec = h.rt.sandboxes[sb.id]
        assert (slots / str(rec.slot)).read_text().split() == [h.rt.name, sb.id]
        assert not [f for f in slots.iterdir() if f.name.startswith(".claim-") and f != live]  # staging file gone
        assert h.destroy(sb.id)
        assert not (slots / str(rec.slot)).exists()  # given back with the sandbox
    finally:
        live.unlink(missing_ok=True)
        h.close()
    assert h.leftovers() == [], h.leftovers()
