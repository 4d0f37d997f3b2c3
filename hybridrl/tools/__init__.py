"""Tool calling for multi-turn rollouts: the built-in tools (entry-point group ``hybridrl.tools``), the tool-call
formats the policy writes (``calls``) and the ``actor_rollout_ref.rollout.multi_turn`` settings (``config``)."""
