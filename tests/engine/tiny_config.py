"""The tiny Llama-family shape the engine tests build their random models from (conftest's `tiny_model`,
the numerics tests)."""

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    initializer_range=0.1,  # sharper attention than the default 0.02: a wrong mask shows in the logits
)
