"""The model's building blocks, each with its own fast path: `norm`, `activation`, `rotary`, `linear` (packed
oneDNN linears) and `quant_linear` (GGUF blocks as stored). Nothing is imported here."""
