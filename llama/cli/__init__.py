"""What the command lines share: one-line errors and checked argument types
(:mod:`~llama.cli.flags`), the example scripts' flags, demo model and way of ending
(:mod:`~llama.cli.examples`), and the interactive chat's input (:mod:`~llama.cli.terminal`).
Nothing here imports torch, so ``--help`` answers at once."""
