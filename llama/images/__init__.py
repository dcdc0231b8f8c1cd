"""Images for the models that see them (Llama 4, Llama 3.2 Vision).

* :mod:`~llama.images.preprocess` (PIL and torch): an image from a ``PIL.Image``, bytes or a
  path, checked before any tensor is built (decompression bombs, truncated or unreadable
  files, zero-sized or too large images), made RGB, then cut into tiles exactly as Meta's
  Llama 4 reference does: ``pixel_values`` ``[n_tiles, 3, 336, 336]`` and the tile grid.
* :mod:`~llama.images.prompt` (no torch): the tile geometry a model's vision arguments give
  (how many ``<|patch|>`` tokens a tile takes) and what an encoded prompt carries for each
  image (its ``pixel_values`` and where its ``<|patch|>`` tokens are), which the chat format
  (:class:`llama.formats.chat.Llama4ChatFormat`) returns with the prompt's token ids; and the
  same for Llama 3.2 Vision (:class:`~llama.images.prompt.MllamaLayout`,
  :class:`~llama.images.prompt.MllamaPromptImage`, returned by
  :class:`llama.formats.chat.Llama3ChatFormat` made with a layout).
* :mod:`~llama.images.mllama` (PIL and torch): Llama 3.2 Vision's tiles, as Meta's
  ``image_transform.py`` makes them: ``pixel_values`` ``[max_num_chunks, 3, 560, 560]`` (zeros
  past the image's tiles) and the aspect-ratio id; and a batch of them laid out as Hugging
  Face's ``MllamaForConditionalGeneration`` takes it.

Nothing here imports torch or PIL until an image is preprocessed, so that the chat formats
stay light to import.
"""
