"""The body check: refuses what the engine cannot represent, names the field, and builds no paths
for a value it accepts (issue 18: a path string per list element held the GIL for 250 ms a body)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ft.server.edge.body as body
from ft.errors import InvalidRequest
from ft.server.edge.body import INT_MAX, MAX_DEPTH, WALK_SLICE, check_value

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(INT_MAX - 3, INT_MAX + 3),
    st.integers(-(2**63) - 3, -(2**63) + 3),
    st.integers(-5, 5),
    st.sampled_from(["a", "\ud800", "b\udfffc", ""]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.sampled_from(["k", "j", "\udc00"]), inner, max_size=3),
    ),
    max_leaves=30,
)


def refusal(value: Any, max_depth: int = MAX_DEPTH) -> tuple[str, str | None] | None:
    try:
        check_value(value, max_depth=max_depth)
    except InvalidRequest as e:
        return str(e), e.param
    return None


@settings(max_examples=300, deadline=None)
@given(VALUES, st.integers(1, 4))
def test_check_refuses_exactly_what_the_naming_walk_refuses(value: Any, max_depth: int) -> None:
    """The fast check and the walk that names the field agree on every value."""
    refused = refusal(value, max_depth)
    try:
        error: InvalidRequest | None = body._first_problem(value, max_depth, True)
    except AssertionError:
        error = None  # the naming walk found nothing: it is only called after a refusal
    assert refused == (None if error is None else (str(error), error.param))


def test_an_accepted_value_builds_no_field_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """300,000 list elements are checked without a path string for any of them."""
    built: list[str] = []
    real = body._child

    def counted(path: str, key: str | int) -> str:
        built.append(path)
        return real(path, key)

    monkeypatch.setattr(body, "_child", counted)
    check_value({"messages": [{"role": "user", "content": "hi"}], "zzz": [7] * 300_000})
    assert built == []


def test_a_refused_value_names_its_field() -> None:
    """A refusal deep in a long list still names the element."""
    value = {"zzz": [7] * (3 * WALK_SLICE) + [{"a": [INT_MAX + 1]}]}
    where = f"zzz[{3 * WALK_SLICE}].a[0]"
    assert refusal(value) == (f"{where} holds an integer outside the 64-bit range", where)


def test_nesting_is_measured_across_long_lists() -> None:
    """Splitting a long list into slices keeps every element at its own depth."""
    deep: Any = 1
    for _ in range(MAX_DEPTH - 1):
        deep = [deep]
    assert refusal([*range(3 * WALK_SLICE), deep]) is None  # the deepest list at depth 63
    assert refusal([*range(3 * WALK_SLICE), [deep]]) is not None
