"""Built-in environments of multi-turn rollouts (entry-point group ``hybridrl.environments``)."""
