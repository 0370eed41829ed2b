"""EngineConfig validates itself with clear ValueErrors."""

from __future__ import annotations

import pytest

from ft.config import EngineConfig


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "float16"}, "dtype"),
        ({"quantize": "int4"}, "quantize"),
        ({"quantize": "int8", "dtype": "bfloat16"}, "bfloat16"),
        ({"page_size": 0}, "page_size"),
        ({"num_pages": 1}, "num_pages"),
        ({"max_running_requests": 0}, "max_running_requests"),
        ({"max_model_len": 3}, "max_model_len"),
        ({"kv_cache_memory": 10}, "kv_cache_memory"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"admission": "greedy"}, "admission"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict[str, object], message: str) -> None:
    """Bad config values are refused with a ValueError naming the field."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)  # type: ignore[arg-type]


def test_defaults_are_valid() -> None:
    """The defaults are valid and are the documented ones."""
    config = EngineConfig()
    assert config.quantize is None and config.dtype == "auto"
    assert config.kv_cache_dtype == "auto" and config.admission == "need"


@pytest.mark.parametrize(
    "argv",
    [["--drain-timeout", "-1"], ["--port", "70000"], ["--tensor-parallel-size", "0"]],
)
def test_ft_serve_refuses_bad_options_on_stderr_with_status_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad option is an error message on stderr and exit status 2, before anything loads."""
    from ft.cli import main

    assert main(["serve", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("ft serve: ")
