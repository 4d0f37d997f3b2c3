"""``hybridrl.vlm.sglang_compat`` is still needed: after SGLang's import, a Qwen2.5-VL vision config is not given its
axial RoPE (transformers' vision tower then refuses to build); inside ``transformers_rope_rules`` it is, and SGLang's
patch is back after. In a process of its own: SGLang's patch is global."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang

CODE = """
import sglang.srt.configs  # applies SGLang's transformers patches
from transformers import PretrainedConfig
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from hybridrl.vlm.sglang_compat import transformers_rope_rules
patched = PretrainedConfig.standardize_rope_params
print("WITHOUT", Qwen2_5_VLVisionConfig().rope_parameters["rope_type"])
with transformers_rope_rules():
    print("WITH", Qwen2_5_VLVisionConfig().rope_parameters["rope_type"])
print("RESTORED", PretrainedConfig.standardize_rope_params is patched)
"""


def test_sglang_leaves_the_vision_rope_unstandardised_and_the_workaround_fixes_it() -> None:
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split() for line in proc.stdout.splitlines() if line.split()[0] in
                 ("WITHOUT", "WITH", "RESTORED"))
    assert lines == {"WITHOUT": "default", "WITH": "axial", "RESTORED": "True"}, proc.stdout
