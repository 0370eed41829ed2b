"""The served model's names: one id, decided from the configuration, and the aliases accepted."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ft.model_names import model_names

NAME_CHARS = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")
names = st.text(NAME_CHARS, min_size=1, max_size=40).filter(lambda n: not n.lower().endswith("gguf"))


def test_the_default_model_is_its_files_stem_and_answers_to_its_other_names() -> None:
    """The default model's id is its file's stem; its README name, file name and repository
    name are aliases; another model's name is not one."""
    n = model_names(None)
    assert n.id == "SmolLM2-135M-Instruct.Q4_1" and n.listed == (n.id,)
    for alias in (
        "SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2-135m-instruct",
    ):
        assert n.accepts(alias), alias
    for other in ("gpt-4o", "SmolLM2-360M-Instruct", "SmolLM2-135M", ""):
        assert not n.accepts(other), other


@pytest.mark.parametrize(
    ("path", "shown", "alias"),
    [
        (
            "/m/Llama-3.2-1B-Instruct-Q4_K_M.gguf",
            "Llama-3.2-1B-Instruct-Q4_K_M",
            "bartowski/Llama-3.2-1B-Instruct-GGUF",
        ),
        ("/m/qwen2.5-0.5b-instruct-fp16.GGUF", "qwen2.5-0.5b-instruct-fp16", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("/hf/Qwen2.5-0.5B-Instruct/", "Qwen2.5-0.5B-Instruct", "qwen/qwen2.5-0.5b-instruct"),
        (
            "/c/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/0123abcd",
            "Qwen2.5-0.5B-Instruct",
            "Qwen/Qwen2.5-0.5B-Instruct",
        ),
    ],
)
def test_a_model_is_shown_by_its_file_or_repository_name(path: str, shown: str, alias: str) -> None:
    """A GGUF by its stem, a directory by its name (a Hugging Face cache snapshot by its
    repository's), and each answers to its repository-style name and to the path it was
    served from (vLLM's name for a model without --served-model-name)."""
    n = model_names(path)
    assert n.id == shown and n.accepts(alias)
    assert n.accepts(path) or "/snapshots/" in path  # a snapshot's path ends in a commit hash


@given(served=st.lists(names, min_size=1, max_size=4), owner=names)
def test_every_served_name_is_listed_accepted_in_any_case_and_the_first_is_the_id(
    served: list[str], owner: str
) -> None:
    """Served names are listed once each in order, the first is the id, and each is accepted
    in any case and under any owner prefix; the file's names stay accepted, never listed."""
    n = model_names("/m/Some-Model.Q8_0.gguf", served)
    assert n.listed == tuple(dict.fromkeys(served)) and n.id == served[0]
    assert not set(n.aliases) & set(n.listed)
    for name in served:
        assert n.accepts(name.swapcase()) and n.accepts(f"{owner}/{name}")
    assert n.accepts("Some-Model") and n.accepts("Some-Model.Q8_0.gguf")
