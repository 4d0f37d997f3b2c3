"""Greedy accuracy in one forward pass: ``MegatronPolicy.greedy_matches`` marks exactly the response tokens that are
transformers' argmax after the tokens before them, at TP = 1, TP = 2 (vocabulary padding in the last shard) and
PP = 2. SFT's ``val/greedy_accuracy`` and ``trainer.target_accuracy`` stand on it."""

from pathlib import Path

import pytest

WORKER = str(Path(__file__).parent / "workers" / "greedy_matches.py")


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "tp", "pp"), [("qwen2_tied", 1, 1), ("odd_vocab", 2, 1), ("qwen2_untied", 1, 2)])
def test_greedy_matches_equal_transformers_argmax(torchrun, tiny_checkpoints: dict[str, Path], name: str, tp: int,
                                                  pp: int) -> None:
    out = torchrun([WORKER, str(tiny_checkpoints[name]), str(tp), str(pp)], nproc=tp * pp)
    assert "OK" in out.stdout
