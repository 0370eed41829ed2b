"""A reranker's pair format: how one (query, document) pair becomes the one sequence a
classification head scores. Torch-free: the loaders build it, the server reads it.

The rule is llama-server's (`format_prompt_rerank`): with a rerank template (a GGUF's
`tokenizer.chat_template.rerank`, as llama.cpp's converter writes for Qwen3-Reranker) the pair is
the template with `{query}` and `{document}` replaced, tokenized with special tokens parsed and no
BOS added; otherwise it is `[BOS] query [EOS] [SEP] document [EOS]`, where each special token is
there only when the tokenizer adds it (`add_bos`, `add_eos`, `add_sep`; EOS falls back to SEP
when the vocabulary has none). For a byte-level BPE decoder that adds none of them (Qwen3, most
Hugging Face `*ForSequenceClassification` checkpoints) that is the query's tokens followed by the
document's, which is also what its tokenizer's `encode(query, document)` gives.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_PLACEHOLDER = re.compile(r"\{query\}|\{document\}")


@dataclass(frozen=True, slots=True)
class RankFormat:
    """A reranker's head outputs and pair format (see the module docstring).

    `score` of the head's outputs is their first value, as llama-server's `/rerank` returns: a
    one-label head's raw logit, or for a two-label Qwen3 head (the converter's `yes`, `no` rows of
    the lm_head, softmaxed by the head) the probability of `yes`.
    """

    num_labels: int
    labels: tuple[str, ...] = ()
    template: str | None = None  # with `{query}` and `{document}`; None: the special-token rule
    bos_id: int | None = None
    eos_id: int | None = None  # the SEP id when the vocabulary has no EOS
    sep_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_sep: bool = False

    def render(self, query: str, document: str) -> str:
        """The template with `{query}` and `{document}` replaced, in one pass (a query holding
        the text `{document}` stays as written)."""
        assert self.template is not None
        return _PLACEHOLDER.sub(lambda m: query if m.group() == "{query}" else document, self.template)

    def pair_ids(self, query_ids: Sequence[int], document_ids: Sequence[int]) -> list[int]:
        """`[BOS] query [EOS] [SEP] document [EOS]`, each special token where the tokenizer adds it."""
        ids: list[int] = []
        if self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        ids.extend(query_ids)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        if self.add_sep and self.sep_id is not None:
            ids.append(self.sep_id)
        ids.extend(document_ids)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    @staticmethod
    def score(outputs: Sequence[float]) -> float:
        """The relevance score of one pair's head outputs: the first."""
        return float(outputs[0])
