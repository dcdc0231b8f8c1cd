"""LoRA adapters (Hugging Face PEFT's files) for the models this library runs: read into
Meta's names (:mod:`llama.lora.adapter`), folded into the base weights, or served unmerged,
many at once, by the engine."""
