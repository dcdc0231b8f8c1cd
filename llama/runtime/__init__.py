"""Where and how the model runs: devices and dtypes, the process groups of a torchrun job
and their bounded collectives (:mod:`~llama.runtime.distributed`), and the checks for
non-finite weights and logits (:mod:`~llama.runtime.finite`)."""
