"""Meta-format checkpoints: ``params.json`` read into :class:`~llama.checkpoint.params.ModelArgs`
(:mod:`~llama.checkpoint.params`), the shards found, opened safely and read lazily, resharded
on load to any process count by one table of split axes (:mod:`~llama.checkpoint.shards`),
the memory check (:mod:`~llama.checkpoint.memory`) and loading a rank's model
(:mod:`~llama.checkpoint.loader`)."""
