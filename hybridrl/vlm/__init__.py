"""Vision-language models (issue 46): multimodal RoPE positions and the Megatron model with its vision tower."""
