"""Megatron-core side of hybridrl; import the submodule you need (this package imports nothing).

Model and weights:

- (the HF architecture, :class:`HFArch`, is read by :mod:`hybridrl.hf.arch`, torch-free)
- ``cpu``: every CPU adaptation of megatron-core, applied by ``apply_cpu_adaptations()``.
- ``parallel``: :class:`ParallelConfig`, ``init_parallel``, ``seed_everything``, ``destroy_parallel``.
- ``model``: ``build_model_chunks`` (TE spec on GPU, local spec otherwise), vocab padding, logits gather.
- ``stages``: which layers each pipeline stage holds (even, or uneven end stages), torch-free.
- ``convert``: HF <-> Megatron layout rules; ``weights``: ``load_hf_weights``, ``export_hf_weights``
  (bucketed, TP-gathered, PP-broadcast stream of HF tensors).
- ``verify``: ``hybridrl verify-model``.
- ``dynamic_batch``: token-budget micro-batches; ``sequences``: the row layout of a forward.
- ``fallbacks``: megatron-core's TE/Apex-missing warnings as one line.
"""
