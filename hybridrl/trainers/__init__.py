"""The jobs: the RL loop (``rl``) and what it is built from (``components``), SFT and DPO (``sft``, ``dpo``),
and their launch sequence (``entry``)."""
