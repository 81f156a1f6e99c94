"""engine/model: the Llama-family model and everything it needs to run on paged KV blocks.

Imports run one way: kernels -> layers -> models <- loading, with attention beside layers (the model reads
its Protocol); `engine.model_runner` assembles them (tests/engine/test_model_imports.py holds this).

- `config`: what we read from config.json, per architecture (`ARCHITECTURES`); no torch.
- `device`: `--device` / `--dtype` resolution (`auto` dtype per CPU tier).
- `transfer`: host -> device copies that never wait for the GPU.
- `kernels/`: Brine's C++ kernels (`csrc/`): `build` (compile once per CPU and tier, bind with ctypes),
  `fused_ops` (RMSNorm, add + RMSNorm, SiLU * up, RoPE + KV write as one call each), `invariance` (the
  batch-invariance probe of torch's matmuls, and the ISA line).
- `layers/`: `norm` (RMSNorm), `activation` (SiLU), `rotary` (RoPE), `linear` (linears on packed oneDNN
  weights, rows padded as probed), `quant_linear` (a GGUF's quantized blocks as stored), `linear_plan` (which
  of those each linear runs as: decided by the loader, applied by the model), `lora` (a linear plus each
  row's adapter delta).
- `attention/`: `base` (per-step metadata and the backend Protocol with its capabilities), one file per
  backend: `native` (the C++ kernel reading the cache in place: CPU's default wherever the kernels build),
  `tiled` (batch-invariant torch ops: CPU's where they do not), `sdpa` (the reference; `--no-batch-invariant`
  without the kernels), `flex` (FlexAttention: CUDA's); `chooser` (the one choice, made by the runner).
- `models/`: `llama` (the Llama family: Llama, Mistral, Qwen2, Qwen3), `registry` (architecture -> model class
  and the native paths it declares: `capabilities`), `context` (`ForwardContext`: one step's state),
  `native_stack` (every decoder layer in one native call, where declared).
- `loading/`: `files` (what the user names -> a local directory; no torch), `gguf_convert` and `gguf_tensors`
  (GGUF files), `quantize` (which linears run as stored), `loader` (`load_model`: the linears' plan from the
  files, then the model built with it).

Nothing is imported here: `engine.model.loading.files` must stay importable without torch.
"""
