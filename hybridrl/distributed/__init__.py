"""Process groups beyond Megatron's: the host (gloo) group for plain Python objects (``host_group``) and the
``HYBRIDRL_CHECK_COLLECTIVES=1`` debug check that each collective's tensors live on its group's device (``check``)."""
