"""RL algorithms as pure-torch functions and plugins: advantage estimators, policy losses,
loss aggregation, KL estimators and entropy.

Plugins (advantage estimators, policy losses) are reached through ``hybridrl.registry.Registry``
by name, never imported from here by the loop. Shapes: ``B`` samples, ``T`` response tokens
(right-padded), ``V`` vocabulary.
"""
