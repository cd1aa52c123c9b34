"""common/http.py: typed 400s for bodies that are not what the handler's model wants."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.errors import APIError
from common.http import validate_body


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    n: int = 1

    @field_validator("n")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError("n must be odd")
        return v


def test_valid_body() -> None:
    assert validate_body(Spec, {"name": "x", "n": 3}) == Spec(name="x", n=3)


@pytest.mark.parametrize(("body", "param", "text"), [
    ([1, 2], None, "must be a JSON object"),
    ({"n": 1}, "name", "invalid name: Field required"),
    ({"name": "x", "extra": 1}, "extra", "unknown field (known: name, n)"),
    ({"name": "x", "n": 2}, "n", "invalid n: n must be odd"),  # no pydantic "Value error, " prefix
])
def test_bad_body_is_a_typed_400(body: object, param: str | None, text: str) -> None:
    with pytest.raises(APIError) as e:
        validate_body(Spec, body)
    assert e.value.status == 400 and e.value.param == param and text in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"
