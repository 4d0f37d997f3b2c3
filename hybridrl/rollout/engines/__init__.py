"""The rollout engines (``hf``, ``sglang``, ``vllm``: the ``hybridrl.rollout_engines`` entry points) and all that only
they use: their process management and reaper, the compat modules for each upstream, weight naming. The rollout
(:mod:`hybridrl.rollout.workers`) owns the engines; nothing here imports the rollout strategies or the trainer."""
