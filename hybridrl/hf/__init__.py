"""The Hugging Face checkpoint format, the interchange format of every model: ``arch`` (its ``config.json``:
the architecture and a directory's problems), ``tensors`` (its safetensors, single or sharded), ``write`` (writing
one from the weight stream, never over something it did not write)."""
