"""LoRA settings (``config``), its adapter checkpoints (``checkpoint``) and peft's format (``peft``); the Megatron
adapters themselves are :mod:`hybridrl.megatron.lora`."""
