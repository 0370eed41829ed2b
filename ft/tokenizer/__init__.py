"""The tokenizer-worker boundary: everything a tokenizer worker process runs, in one place.

`spec` (`TokenizerSpec`: the tokenizer and its chat template as plain data), `template`
(sandboxed jinja2 chat templates), `codec` (CBOR across the process boundary) and `job` (the
worker's entry point). No torch and no trio here, so worker processes start fast and stay
small.
"""
