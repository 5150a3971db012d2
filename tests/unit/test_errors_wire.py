"""The one error wire format: every error class has an HTTP status, and encode/decode round-trip."""

from __future__ import annotations

import json

import pytest

import dsec.errors as errors
from dsec.errors import (
    ERRORS_BY_CODE,
    AuthError,
    Backpressure,
    DsecError,
    decode_error,
    encode_error,
)
from dsec.spec.api import STATUS_BY_CODE


def _all_error_classes() -> set[type[DsecError]]:
    seen: set[type[DsecError]] = set()
    todo: list[type[DsecError]] = [DsecError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == errors.__name__ and cls not in seen:
            seen.add(cls)
            todo.extend(cls.__subclasses__())
    return seen


def test_every_error_class_has_a_code_in_the_table_and_a_status() -> None:
    classes = _all_error_classes()
    assert classes == set(ERRORS_BY_CODE.values()), classes ^ set(ERRORS_BY_CODE.values())
    assert len({c.code for c in classes}) == len(classes), "two classes share a wire code"
    for cls in classes:
        assert 400 <= cls.http_status <= 599, cls
        assert "http_status" in cls.__dict__, f"{cls.__name__} inherits its status: say it"
    assert {code: cls.http_status for code, cls in ERRORS_BY_CODE.items()} == STATUS_BY_CODE


@pytest.mark.parametrize("cls", sorted(ERRORS_BY_CODE.values(), key=lambda c: c.code), ids=lambda c: c.code)
def test_encode_decode_round_trip(cls: type[DsecError]) -> None:
    exc = cls("it went wrong", sandbox_id="sb-1", count=3, tags=["a"], detail={"k": 1})
    status, body, headers = encode_error(exc)
    assert status == cls.http_status
    back = decode_error(status, json.loads(json.dumps(body)), headers)
    assert type(back) is cls
    assert back.message == "it went wrong" and str(back) == "it went wrong"
    assert {k: back.fields[k] for k in ("sandbox_id", "count", "tags", "detail")} == {
        "sandbox_id": "sb-1", "count": 3, "tags": ["a"], "detail": {"k": 1}}
    assert back.fields["status"] == status
    assert isinstance(back, Exception) and back.code == cls.code


def test_headers_and_fields_that_are_not_json() -> None:
    status, body, headers = encode_error(Backpressure("busy", retry_after=2.2, reason="memory"))
    assert (status, headers) == (429, {"Retry-After": "3"})
    back = decode_error(status, body, headers)
    assert isinstance(back, Backpressure) and back.fields["retry_after"] == 2.2
    # A 429 body without retry_after takes the header's.
    assert decode_error(429, {"error": {"code": "backpressure", "message": "m"}}, {"Retry-After": "7"}).fields[
        "retry_after"] == 7.0
    assert encode_error(AuthError("no token"), realm="dsec-edge")[2] == {"WWW-Authenticate": 'Bearer realm="dsec-edge"'}
    assert encode_error(AuthError("no token"))[2] == {}
    # A field that is not plain JSON goes through `default` (the edge sends an ExecResult's wire form).
    _, body, _ = encode_error(DsecError("x", obj=object()), default=lambda v: "converted")
    assert body["error"]["obj"] == "converted"


def test_answers_that_are_not_ours() -> None:
    assert isinstance(decode_error(401, "<html>"), AuthError)
    bp = decode_error(429, None, {"retry-after": "4"})
    assert isinstance(bp, Backpressure) and bp.fields["retry_after"] == 4.0
    e = decode_error(502, "bad gateway", where="http://edge:1")
    assert type(e) is DsecError and e.fields["status"] == 502 and "HTTP 502 from http://edge:1" in str(e)
    # An unknown code is still a DsecError, with its message and fields.
    e = decode_error(500, {"error": {"code": "from_the_future", "message": "m", "x": 1}})
    assert type(e) is DsecError and e.message == "m" and e.fields["x"] == 1
