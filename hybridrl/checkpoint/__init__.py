"""Checkpoints: RL checkpoints (``rl``: atomic, reshardable; its parts ``layout``, ``resume``, ``state``, ``save``,
``load``; LoRA adapters in :mod:`hybridrl.lora.checkpoint`) and ``export`` (``hybridrl export-hf``: an RL checkpoint
as an HF one)."""
