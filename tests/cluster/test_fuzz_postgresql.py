"""The control plane's API fuzz on PostgreSQL, run wherever the cluster suite runs (issue 14).

The fuzz itself lives in tests/integration/test_control_fuzz.py (schemathesis against the
OpenAPI document, no 5xx, nothing left on the edge); this module runs its PostgreSQL case
as part of ``pytest -m slow tests/cluster`` and of CI's slow set. Slow: ~2.5 min.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

import test_control_fuzz as fuzz
import test_control_support as support

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

anyio_backend = support.anyio_backend
pg_cluster = support.pg_cluster


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from support.database_url("postgresql", request, tmp_path)


async def test_api_fuzz_on_postgresql(db_url: str, tmp_path: Path) -> None:
    await fuzz.test_schemathesis_finds_no_server_errors(db_url, tmp_path)
