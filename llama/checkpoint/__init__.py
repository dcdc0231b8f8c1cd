"""Meta-format checkpoints: ``params.json`` read into :class:`~llama.args.ModelArgs`, the
shards found, opened safely and read lazily, resharded on load to any process count by the
tensor-parallel plan's table of split axes (:mod:`llama.layers.tensor_parallel`, shared with
the model's layers; :mod:`~llama.checkpoint.shards`),
the memory check (:mod:`~llama.checkpoint.memory`) and loading a rank's model
(:mod:`~llama.checkpoint.loader`)."""
