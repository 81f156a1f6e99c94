"""Where weights come from and how they become a model: `files` (name -> local directory; no torch), `gguf_convert`
and `gguf_tensors` (GGUF files), `quantize` (which linears run as stored), `loader` (`load_model`). Nothing is
imported here: `engine.model.loading.files` must stay importable without torch."""
