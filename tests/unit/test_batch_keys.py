"""A batch's request id leaves room for every item's key (``<request_id>/<i>``): the API
fuzz found a 127-character one answered 500 (the item's create refused its own key)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dsec.spec import ImageRef, SandboxSpec
from dsec.spec.api import CreateBatch, CreateSandbox

SPEC = SandboxSpec(image=ImageRef(base="busybox"))


def test_the_longest_batch_request_id_makes_valid_item_keys() -> None:
    batch = CreateBatch(spec=SPEC, count=1000, request_id="r" * 123)
    assert batch.request_id is not None
    for i in (0, 999):
        CreateSandbox(spec=SPEC, request_id=f"{batch.request_id}/{i}")  # no error


def test_a_longer_one_is_refused_up_front() -> None:
    with pytest.raises(ValidationError, match="123"):
        CreateBatch(spec=SPEC, count=1, request_id="r" * 124)
