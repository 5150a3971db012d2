"""Plain results of the SDK that its parts share (the client, leases, terminals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic

from dsec.errors import DsecError, InvalidSpec

if TYPE_CHECKING:
    from dsec.sdk.client import AsyncSandbox

W = TypeVar("W", bound=pydantic.BaseModel)


@dataclass(frozen=True, slots=True)
class OutputChunk:
    stream: str  # "stdout" or "stderr"
    data: bytes
    dropped: int = 0
    """Bytes of this stream left out just before ``data``: only with ``output_cap=``, on the
    chunk that carries the tail (the head came first, as produced)."""


@dataclass(frozen=True, slots=True)
class CreateOutcome:
    """One item of :meth:`AsyncClient.create_many`: a sandbox or the error that stopped it."""

    index: int
    sandbox: AsyncSandbox | None
    error: DsecError | None

    @property
    def ok(self) -> bool:
        return self.sandbox is not None


def wire_body(model: type[W], **fields: Any) -> W:
    """Build a request body; bad arguments raise InvalidSpec naming the field (not a pydantic error)."""
    try:
        return model(**fields)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(x) for x in first.get("loc", ())) or "body"
        raise InvalidSpec(f"{field}: {first.get('msg', 'invalid')}", field=field) from None


__all__ = ["CreateOutcome", "OutputChunk", "wire_body"]
