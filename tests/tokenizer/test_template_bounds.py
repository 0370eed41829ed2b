"""A chat template is untrusted input: its powers and repeats are bounded before they run."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from ft.errors import InvalidRequest
from ft.tokenizer.template import compile_template, render_chat

USER = [{"role": "user", "content": "hi"}]


def test_a_huge_power_is_refused_at_once_instead_of_hanging() -> None:
    """`{{ 7 ** 77777777 }}` ran for minutes (jinja folded it while compiling the template)."""
    start = time.thread_time()  # CPU: a neighbour's load is not the template's
    with pytest.raises(InvalidRequest, match="chat template error.*power") as info:
        render_chat("{{ 7 ** 77777777 }}", USER)
    assert time.thread_time() - start < 1.0
    assert info.value.param == "messages"


def test_a_huge_power_is_not_folded_while_compiling() -> None:
    start = time.thread_time()
    compile_template("{% if false %}{{ 9 ** 99999999 }}{% endif %}")
    assert time.thread_time() - start < 1.0


def test_a_huge_repeat_is_refused_without_allocating_it() -> None:
    """`'x' * 800000000` rendered, with a 3.2 GB peak per chat request."""
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest, match="chat template error.*longer than"):
            render_chat("{{ 'x' * 800000000 }}", USER)
        with pytest.raises(InvalidRequest, match="longer than"):
            render_chat("{{ ([messages[0]] * 100000000) | length }}", USER)
        with pytest.raises(InvalidRequest, match="longer than"):
            render_chat("{{ 400000000 * messages[0]['content'] }}", USER)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_ordinary_powers_and_repeats_still_render() -> None:
    template = "{{ 2 ** 10 }} {{ '-' * 3 }} {{ [1, 2] * 2 }} {{ 3 * 'ab' }} {{ 2 ** -1 }} {{ 1 ** 99999999 }}"
    assert render_chat(template, USER) == "1024 --- [1, 2, 1, 2] ababab 0.5 1"


def test_a_huge_range_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="chat template error"):
        render_chat("{% for i in range(10 ** 9) %}{% endfor %}", USER)
