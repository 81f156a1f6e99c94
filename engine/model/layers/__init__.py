"""The model's building blocks, each with its own fast path: `norm`, `activation`, `rotary`, `linear` (packed
oneDNN linears) and `quant_linear` (GGUF blocks as stored), `linear_plan` (which of them each of a model's linears runs as) and
`lora` (a linear plus each row's adapter delta). Nothing is imported here."""
