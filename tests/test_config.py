"""EngineConfig and ServerSettings refuse bad values with clear ValueErrors; the options reach them."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from ft.bench import add_bench_arguments
from ft.cli_serve import add_serve_arguments, configs_from_args, read_api_key_file
from ft.config import EngineConfig
from ft.server.settings import ServerSettings


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
        ({"speculative_method": "eagle"}, "speculative_method"),
        ({"speculative_tokens": 0}, "speculative_tokens"),
        ({"speculative_tokens": 33}, "speculative_tokens"),
        ({"speculative_max_batch": 0}, "speculative_max_batch"),
        ({"speculative_method": "draft"}, "needs a speculative_model"),
        ({"speculative_model": "small.gguf"}, "speculative_method draft"),
        ({"speculative_method": "ngram", "speculative_model": "small.gguf"}, "speculative_method draft"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict[str, object], message: str) -> None:
    """Bad config values are refused with a ValueError naming the field."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)  # type: ignore[arg-type]


def test_a_draft_model_goes_with_tensor_parallelism() -> None:
    """It runs in rank 0 only; its drafts are verified by every rank's step."""
    config = EngineConfig(speculative_method="draft", speculative_model="small.gguf", tensor_parallel_size=2)
    assert config.tensor_parallel_size == 2


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


def serve_args(*argv: str) -> argparse.Namespace:
    """`ft serve ARGV`, parsed."""
    parser = argparse.ArgumentParser(prog="ft serve")
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_ft_serve_sets_the_engine_fields_it_had_no_flag_for() -> None:
    """`--no-enable-prefix-caching`, `--tokenizer-workers`, `--compute-threads` and several
    `--served-model-name`s reach `EngineConfig`; the parsers reach `ServerSettings`."""
    engine, settings = configs_from_args(
        serve_args(
            "--no-enable-prefix-caching",
            "--tokenizer-workers=3",
            "--compute-threads=2",
            "--served-model-name",
            "a",
            "org/b",
            "--tool-call-parser=llama3_json",
            "--reasoning-parser=think",
            "--strict-model-names",
        )
    )
    assert engine.enable_prefix_caching is False and engine.tokenizer_workers == 3
    assert engine.compute_threads == 2 and engine.served_names == ("a", "org/b")
    assert settings.tool_call_parser == "llama3_json" and settings.reasoning_parser == "think"
    assert settings.strict_model_names is True
    assert configs_from_args(serve_args("--enable-prefix-caching"))[0].enable_prefix_caching is True


@pytest.mark.parametrize("argv", [["--compute-threads", "3"], ["--threads", "3"]])
def test_ft_bench_takes_compute_threads_as_ft_serve_does(argv: list[str]) -> None:
    """`ft bench` spells the option as `ft serve` does (the old `--threads` still works)."""
    parser = argparse.ArgumentParser(prog="ft bench")
    add_bench_arguments(parser)
    assert parser.parse_args(argv).compute_threads == 3
    assert "--threads" not in parser.format_help()


def test_the_speculative_options_reach_the_config_of_serve_and_bench() -> None:
    config = configs_from_args(
        serve_args(
            "--speculative-method", "ngram", "--speculative-tokens", "6", "--speculative-max-batch", "2"
        )
    )[0]
    assert (config.speculative_method, config.speculative_tokens, config.speculative_max_batch) == (
        "ngram",
        6,
        2,
    )
    assert configs_from_args(serve_args())[0].speculative_method is None  # off by default
    config = configs_from_args(
        serve_args("--speculative-method", "draft", "--speculative-model", "/models/small.gguf")
    )[0]
    assert (config.speculative_method, config.speculative_model) == ("draft", "/models/small.gguf")
    parser = argparse.ArgumentParser(prog="ft bench")
    add_bench_arguments(parser)
    args = parser.parse_args(["--speculative-method", "ngram", "--prompts", "edit"])
    assert args.speculative_method == "ngram" and args.prompts == "edit"


@pytest.mark.parametrize(
    "fields",
    [{"served_model_name": ""}, {"served_model_name": ("a", " b")}, {"served_model_name": "x" * 257}],
)
def test_bad_served_model_names_are_refused(fields: dict[str, object]) -> None:
    """A served name is 1..256 printable characters with no space around it."""
    with pytest.raises(ValueError, match="served_model_name"):
        EngineConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("fields", [{"tool_call_parser": "xml"}, {"reasoning_parser": "nope"}])
def test_unknown_parsers_are_refused_when_the_settings_are_built(fields: dict[str, object]) -> None:
    """An unknown parser is refused at start, not on the first request that needs it."""
    with pytest.raises(ValueError, match=next(iter(fields))):
        ServerSettings(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_cache_dir": ""}, "prompt_cache_dir"),
        ({"prompt_cache_dir": "/tmp/x", "enable_prefix_caching": False}, "prefix caching"),
        ({"prompt_cache_dir": "/tmp/x", "tensor_parallel_size": 2}, "tensor parallelism"),
        ({"prompt_cache_size": 1000}, "prompt_cache_size"),
        ({"prompt_cache_min_tokens": 0}, "prompt_cache_min_tokens"),
    ],
)
def test_prompt_cache_options_refuse_what_cannot_work(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)  # type: ignore[arg-type]


def test_prompt_cache_flags_reach_the_config() -> None:
    """`--prompt-cache-size` reads sizes like `--kv-cache-memory`; off unless a directory is given."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    engine, _ = configs_from_args(parser.parse_args([]))
    assert engine.prompt_cache_dir is None and engine.prompt_cache_size == 4 << 30
    args = parser.parse_args(["--prompt-cache-dir", "/var/cache/ft", "--prompt-cache-size", "512M"])
    engine, _ = configs_from_args(args)
    assert engine.prompt_cache_dir == "/var/cache/ft" and engine.prompt_cache_size == 512 << 20


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["bench"]])
def test_commands_that_generate_refuse_max_tokens_zero(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--max-tokens 0` (the prompt scored, nothing generated: the embedded API's and
    `/v1/completions`' with echo) would print nothing, or divide by zero in `ft bench`: an
    argparse error, status 2, before anything loads."""
    from ft.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command[0], "--max-tokens", "0", *command[1:]])
    assert exit_info.value.code == 2
    assert "--max-tokens: must be at least 1, got 0" in capsys.readouterr().err


def test_ft_serve_takes_several_api_keys_from_flags_and_a_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nkey-c\n\n  key-d  \n#key-e is retired\n", encoding="utf-8")
    monkeypatch.setenv("FT_API_KEY", "from-env")
    _, settings = configs_from_args(
        serve_args("--api-key", "key-a", "--api-key=key-b", "--api-key-file", str(keys))
    )
    assert settings.all_api_keys == ("key-a", "key-b", "key-c", "key-d")  # --api-key wins over the env
    assert configs_from_args(serve_args())[1].all_api_keys == ("from-env",)
    assert configs_from_args(serve_args("--api-key-file", str(keys)))[1].all_api_keys == (
        "from-env",
        "key-c",
        "key-d",
    )
    monkeypatch.delenv("FT_API_KEY")
    assert configs_from_args(serve_args())[1].all_api_keys == ()


def test_an_api_key_file_past_the_bound_or_unreadable_is_refused_without_its_keys(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    many = tmp_path / "many"
    many.write_text("".join(f"secret-{i}\n" for i in range(4097)), encoding="utf-8")
    for path in (many, tmp_path / "missing"):
        with pytest.raises(SystemExit) as e:
            serve_args("--api-key-file", str(path))
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--api-key-file" in err and "secret-" not in err
    assert "4097 keys" in str(pytest.raises(argparse.ArgumentTypeError, read_api_key_file, str(many)).value)


def test_an_api_key_file_without_keys_is_refused_not_an_open_server(tmp_path: pathlib.Path) -> None:
    for text in ("", "\n\n", "# all keys rotated out\n"):
        path = tmp_path / "keys"
        path.write_text(text)
        with pytest.raises(argparse.ArgumentTypeError, match="no API key"):
            read_api_key_file(str(path))


def test_an_api_key_file_saved_with_a_bom_reads_its_first_key(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys"
    path.write_bytes("\ufeffalpha\r\n# note\r\nbeta\r\n".encode())
    assert read_api_key_file(str(path)) == ("alpha", "beta")
