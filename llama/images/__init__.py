"""Images for the models that see them (Llama 4).

* :mod:`~llama.images.preprocess` (PIL and torch): an image from a ``PIL.Image``, bytes or a
  path, checked before any tensor is built (decompression bombs, truncated or unreadable
  files, zero-sized or too large images), made RGB, then cut into tiles exactly as Meta's
  Llama 4 reference does: ``pixel_values`` ``[n_tiles, 3, 336, 336]`` and the tile grid.
* :mod:`~llama.images.prompt` (no torch): the tile geometry a model's vision arguments give
  (how many ``<|patch|>`` tokens a tile takes) and what an encoded prompt carries for each
  image (its ``pixel_values`` and where its ``<|patch|>`` tokens are), which the chat format
  (:class:`llama.formats.chat.Llama4ChatFormat`) returns with the prompt's token ids.

Nothing here imports torch or PIL until an image is preprocessed, so that the chat formats
stay light to import.
"""
