"""Torch model layer: loaders (GGUF, Hugging Face), the Llama-family decoder, runner, sampler.

Deliberately empty of imports, so that importing one submodule does not load torch (1.8 s and
~250 MB) before it is needed. Import the submodules directly
(`from ft.model.loader import load_model`). Tokenizers and chat templates are in `ft.tokenizer`.
"""
