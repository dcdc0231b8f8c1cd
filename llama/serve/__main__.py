"""``python -m llama.serve``: the OpenAI-compatible server (see :mod:`llama.serve`)."""

from llama.serve import cli

cli()
