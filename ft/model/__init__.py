"""Torch model layer: loaders (GGUF, Hugging Face), the Llama-family decoder, runner, sampler,
templates.

Deliberately empty of imports: tokenizer worker processes import `ft.model.template` and
`ft.model.tokenizer`, and must not pay for torch (1.8 s and ~250 MB each). Import the
submodules directly (`from ft.model.loader import load_model`).
"""
