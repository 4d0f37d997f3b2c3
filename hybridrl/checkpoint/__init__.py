"""Checkpoints: RL checkpoints (``rl``: atomic, reshardable; LoRA adapters in :mod:`hybridrl.lora.checkpoint`) and
``export`` (``hybridrl export-hf``: an RL checkpoint as an HF one)."""
