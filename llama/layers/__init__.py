"""The model's layers and how their products run: the tensor-parallel plan, which tensor is
split along which axis over the ranks (:mod:`~llama.layers.tensor_parallel`), fairscale's
tensor-parallel layers without their full-size initial weights (:mod:`~llama.layers.parallel`), half-precision
weights packed for CPU kernels (:mod:`~llama.layers.packing`), and int8 / int4 / w8a8
quantisation (:mod:`~llama.layers.quantize`)."""
