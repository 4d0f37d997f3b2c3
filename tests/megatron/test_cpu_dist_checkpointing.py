"""``use_cpu_in_dist_checkpointing`` is still needed: without it Megatron's checkpoint writer calls
``torch.cuda.synchronize()`` and a CPU save fails; with it the save round-trips."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor
    from hybridrl.megatron import cpu
    cpu.use_cpu_as_current_device()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    def state(t):
        return {"w": ShardedTensor.from_rank_offsets("w", t, replica_id=0)}
    if sys.argv[2] == "adapted":
        cpu.use_cpu_in_dist_checkpointing()
    try:
        dist_checkpointing.save(state(torch.arange(6.0)), sys.argv[1])
    except Exception as e:
        print("FAILED", type(e).__name__, e)
        sys.exit(0)
    loaded = dist_checkpointing.load(state(torch.zeros(6)), sys.argv[1])
    print("OK", loaded["w"].tolist())
""")


def _run(tmp: Path, mode: str) -> str:
    out = tmp / mode
    out.mkdir()
    code = f"if __name__ == '__main__':\n{textwrap.indent(SCRIPT, '    ')}"
    r = subprocess.run([sys.executable, "-c", code, str(out), mode], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_dist_checkpointing_save_needs_the_adaptation_on_cpu(tmp_path: Path) -> None:
    assert _run(tmp_path, "upstream") == "FAILED AssertionError Torch not compiled with CUDA enabled"
    assert _run(tmp_path, "adapted") == "OK [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]"
