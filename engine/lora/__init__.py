"""LoRA adapters served beside the base model (`brine serve --enable-lora`).

- `peft_format`: reading one adapter in PEFT's layout (adapter_config.json + adapter_model.safetensors) and its
  content fingerprint;
- `delta`: the low-rank products of one adapter's target, row-count invariant like the base linears;
- `adapter`: `LoRAAdapter`, one loaded adapter (name, fingerprint, its delta modules);
- `manager`: `LoRAManager`, the registry of loaded adapters and the per-step row groups the wrappers read.

The wrappers themselves (`engine.model.layers.lora.LoRALinear`, which adds each row's delta to a base linear,
gathered per adapter, punica-style) are the model's: `LlamaForCausalLM.enable_lora` wraps its own linears.
"""
