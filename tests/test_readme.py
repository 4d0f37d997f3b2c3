"""docs/plugins.md shows the example plugin's files as they are: its "Write a plugin" blocks equal the files."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_write_a_plugin_shows_the_example_files_verbatim() -> None:
    page = (REPO / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"^`(plugins/[^`]+)`[^\n]*:\n\n```\w*\n(.*?)\n```$", page, flags=re.M | re.S)
    assert [path for path, _ in blocks] == ["plugins/hybridrl-length-reward/pyproject.toml",
                                            "plugins/hybridrl-length-reward/hybridrl_length_reward/__init__.py",
                                            "plugins/hybridrl-length-reward/tests/test_length_reward.py"]
    for path, text in blocks:
        assert text == (REPO / path).read_text().rstrip("\n"), f"docs/plugins.md's copy of {path} is out of date"
