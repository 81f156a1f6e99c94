"""The model classes (`llama`: the Llama family), the decoder layers as one native call (`native_stack`), and the
registry of architectures (`registry`). Nothing is imported here."""
