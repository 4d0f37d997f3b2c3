"""Worker: ``use_fused_kernels`` decided once for every rank (``policy._fused_kernels_everywhere``) when the last
rank cannot use the fused kernels (``HYBRIDRL_DISABLE_CPP_OPS=1`` there only). Writes each rank's decisions to
``OUT_DIR/<rank>.json``.

    python -m torch.distributed.run --nproc-per-node 2 fused_agree.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch

if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    os.environ["HYBRIDRL_DISABLE_CPP_OPS"] = "1"  # read when the kernels are first loaded

from hybridrl.megatron.parallel import ParallelConfig, destroy_parallel, init_parallel  # noqa: E402
from hybridrl.megatron.policy import _fused_kernels_everywhere  # noqa: E402

torch.set_num_threads(1)
init_parallel(ParallelConfig())
cpu = torch.device("cpu")
out: dict[str, object] = {"null": _fused_kernels_everywhere(None, cpu), "false": _fused_kernels_everywhere(False, cpu)}
try:
    out["true"] = _fused_kernels_everywhere(True, cpu)
except RuntimeError as e:  # on every rank, not only where they are missing
    out["true"] = f"error: {e}"
destroy_parallel()
(Path(sys.argv[1]) / f"{os.environ['RANK']}.json").write_text(json.dumps(out))
