"""``python -m llama.convert``: Hugging Face <-> Meta conversion and resharding (see :mod:`llama.convert`)."""

import sys

from llama.convert.cli import main

sys.exit(main())
