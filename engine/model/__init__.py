"""engine/model: the Llama-family model and everything it needs to run on paged KV blocks.

- `config`: what we read from config.json, and which architectures / settings we support.
- `loader`: safetensors -> `llama.LlamaForCausalLM` (fused q/k/v and gate/up).
- `cpu_linear`: linears on weights pre-packed for oneDNN (CPU, bfloat16 and float32), rows padded as probed.
- `invariance`: which row counts keep this CPU's matmuls batch-invariant (a probe), and the ISA line.
- `llama`: the model over a flat batch of tokens.
- `attention`: per-step metadata, the backend interface, the SDPA backend (`--no-batch-invariant` on CPU).
- `tiled_attention`: the batch-invariant paged attention, CPU's default.
- `flex_attention`: the FlexAttention backend used on CUDA.
- `device`: `--device` / `--dtype` resolution and the choice of backend.
- `files`, `gguf_convert`: where the weights come from.

Nothing is imported here: `engine.model.files` must stay importable without torch.
"""
