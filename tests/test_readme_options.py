"""The README says what the code does: its `ft serve` options table lists exactly the options
`ft serve --help` lists, spelled the same, with the same defaults; the defaults are the config
records' (`EngineConfig`, `ServerSettings`); and its `EngineConfig` bullet gives the record's
defaults."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from ft.cli_serve import add_serve_arguments, configs_from_args, format_size, parse_size
from ft.config import EngineConfig
from ft.server.settings import ServerSettings

README = Path(__file__).parents[1] / "README.md"
STATED_DEFAULT = re.compile(r"\(default: (.+)\)$")


@pytest.fixture
def parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """`ft serve`'s parser, built with no `$FT_API_KEY` / `$FT_ADMIN_KEY` in the environment."""
    monkeypatch.delenv("FT_API_KEY", raising=False)
    monkeypatch.delenv("FT_ADMIN_KEY", raising=False)
    p = argparse.ArgumentParser(prog="ft serve")
    add_serve_arguments(p)
    return p


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option as `--help` spells it (`--page-size N`, `--dtype {auto,...}`), and its action."""
    formatter = parser._get_formatter()
    return {
        formatter._format_action_invocation(a): a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction)
    }


def readme_table() -> dict[str, str]:
    """The README's `ft serve` options table: option (backticks dropped) -> default cell."""
    section = README.read_text(encoding="utf-8").split("### Options", 1)[1]
    rows = [line for line in section.split("\n\n", 2)[1].splitlines() if line.startswith("|")]
    table: dict[str, str] = {}
    for row in rows[2:]:  # past the header and its rule
        option, default, _meaning = (cell.strip() for cell in row.strip("|").split(" | ", 2))
        table[option.replace("`", "")] = default.replace("`", "")
    return table


def stated_default(action: argparse.Action) -> str:
    """What the option's `--help` says its default is (every help ends with one)."""
    text = (action.help or "") % {"default": action.default}
    match = STATED_DEFAULT.search(text)
    assert match, f"{action.option_strings[0]}: its help does not end with (default: ...)"
    return match.group(1)


def test_the_readme_table_lists_exactly_the_options_of_ft_serve_help(parser: argparse.ArgumentParser) -> None:
    """Every `ft serve` option is in the table, spelled as `--help` spells it, and the table
    lists no option `ft serve` lacks."""
    in_help, in_readme = set(options(parser)), set(readme_table())
    assert in_help - in_readme == set(), "in ft serve --help but not in the README's table"
    assert in_readme - in_help == set(), "in the README's table but not in ft serve --help"


def test_the_readme_table_gives_the_defaults_ft_serve_help_gives(parser: argparse.ArgumentParser) -> None:
    """Each row's default is the one `ft serve --help` states."""
    table = readme_table()
    for option, action in options(parser).items():
        assert table.get(option) == stated_default(action), option


def test_the_defaults_help_states_are_the_ones_used(parser: argparse.ArgumentParser) -> None:
    """A default `--help` states as a value is the option's real default, in the spelling the
    option reads (`1GiB` for a size, `off` for a flag that is not set)."""
    for option, action in options(parser).items():
        value, stated = action.default, stated_default(action)
        if isinstance(value, bool):
            assert stated == ("on" if value else "off"), option
        elif action.type is parse_size and value is not None:  # no default: described in words
            assert stated == format_size(value) and parse_size(stated) == value, option
        elif isinstance(value, float):
            assert float(stated) == value, option
        elif isinstance(value, int | str):
            assert stated == str(value), option
        else:
            assert value in (None, ()), option  # described in words: "none", "the model's"


def test_ft_serve_without_options_builds_the_records_defaults(parser: argparse.ArgumentParser) -> None:
    """The CLI's defaults are `EngineConfig()`'s and `ServerSettings()`'s, field for field."""
    engine, settings = configs_from_args(parser.parse_args([]))
    assert engine == EngineConfig()
    assert settings == ServerSettings()


def test_the_engine_config_bullet_gives_the_records_defaults() -> None:
    """The README's `EngineConfig` bullet states each default it names as the record has it
    (it said 16 running requests and 512 prefill tokens where the code had 32 and 1024)."""
    text = README.read_text(encoding="utf-8")
    bullet = text.split("- `EngineConfig`:", 1)[1].split("\n- ", 1)[0]
    defaults = EngineConfig()
    names = {f.name for f in fields(EngineConfig)}
    # `field` (value...): a default, unless the field has none (then it describes the values).
    stated = [
        (n, v.replace("`", ""))
        for n, v in re.findall(r"`(\w+)` \(([^)]*)\)", bullet)
        if n in names and getattr(defaults, n) is not None
    ]
    assert len(stated) >= 8, "the bullet names the record's defaults"
    for name, value in stated:
        default = getattr(defaults, name)
        match = re.match(r'"?(\d+(?: GiB)?|[\w.]+)"?', value)
        assert match, (name, value)
        token = match.group(1)
        if isinstance(default, bool):
            assert token == str(default), name
        elif name == "kv_cache_memory":
            assert parse_size(token.replace(" ", "")) == default, name
        elif isinstance(default, int | float):
            assert float(token) == default, name
        else:
            assert token == default, name
