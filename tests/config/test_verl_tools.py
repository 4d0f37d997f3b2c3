"""verl's tool YAML (``multi_turn.tool_config_path``) read into hybridrl's tool plugins (issue 42): a plugin named by
its entry-point name or its class, verl's sandbox-fusion code tool as ``python``, its Gsm8kTool as ``gsm8k``, and
every other class, a schema that differs, a missing file or bad YAML refused naming the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate

KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
VERL_TOOLS = Path(__file__).resolve().parents[1] / "fixtures" / "verl" / "tool_config"
CALCULATOR_SCHEMA = """    tool_schema:
      type: function
      function:
        name: calculator
        description: "Integer arithmetic."
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""


def compose(path: Path, *more: str) -> object:
    return compose_config(["recipe=grpo_tiny", f"{KEY}={path}", *more])


def refusal(path: Path, *more: str) -> str:
    """The one issue the file gets."""
    with pytest.raises(ConfigError) as e:
        compose(path, *more)
    (issue,) = e.value.issues
    assert issue.key == KEY and "\n" not in issue.message
    return str(issue)


def test_a_plugin_named_by_its_entry_point_or_its_class_is_that_tool(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    by_name = tmp_path / "by_name.yaml"
    by_name.write_text("tools:\n  - class_name: calculator\n    config: {type: native, max_digits: 50}\n")
    m = compose(by_name).actor_rollout_ref.rollout.multi_turn
    assert m.tools == ["calculator"] and m.tool_kwargs == {"calculator": {"max_digits": 50}}
    by_class = tmp_path / "by_class.yaml"
    by_class.write_text("tools:\n  - class_name: hybridrl.tools.calculator.Calculator\n"
                        "    config:\n      type: native\n" + CALCULATOR_SCHEMA)
    m = compose(by_class, "+actor_rollout_ref.rollout.multi_turn.tool_kwargs.calculator.max_length=80",
                "actor_rollout_ref.rollout.multi_turn.tools=[calculator]").actor_rollout_ref.rollout.multi_turn
    assert m.tools == ["calculator"] and m.tool_kwargs == {"calculator": {"max_length": 80}}
    out = capsys.readouterr().out
    assert f"verl's {KEY}={by_class} is hybridrl's actor_rollout_ref.rollout.multi_turn.tools=['calculator']" in out
    assert "the policy reads hybridrl's calculator description, not the file's" in out
    cfg = compose_config(["recipe=grpo_tool_tiny", f"{KEY}={by_name}"])  # a multi-turn recipe that lists it too
    m = validate(cfg, before_bootstrap=True).config.actor_rollout_ref.rollout.multi_turn
    assert m.tools == ["calculator"] and m.tool_kwargs == {"calculator": {"max_digits": 50}}
    other = tmp_path / "other.yaml"
    other.write_text(by_class.read_text().replace("expression", "expr"))
    assert "tool_schema has the parameters {'expr': 'string'}, hybridrl's tool {'expression': 'string'}; requires " \
           "['expr'], hybridrl's tool ['expression']" in refusal(other)


def test_the_plugins_config_checks_the_files_keys(tmp_path: Path) -> None:
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: calculator\n    config: {type: native, max_digit: 50}\n")
    said = refusal(bad)
    assert str(bad) in said and "max_digit" in said and "Valid keys of 'calculator': max_digits: int" in said
    bad.write_text("tools:\n  - class_name: calculator\n    config: {type: native, max_digits: 50}\n")
    said = refusal(bad, "+actor_rollout_ref.rollout.multi_turn.tool_kwargs.calculator.max_digits=9")
    assert "sets calculator's max_digits=50, and actor_rollout_ref.rollout.multi_turn.tool_kwargs.calculator." \
           "max_digits=9: set one" in said


def test_verls_sandbox_tool_is_python_under_the_plugins_own_schema(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    verl = VERL_TOOLS / "sandbox_fusion_tool_config.yaml"  # verl's own file: the tool is called code_interpreter
    said = refusal(verl)
    assert "tool_schema names the function 'code_interpreter', hybridrl's tool 'python'" in said
    renamed = tmp_path / "sandbox.yaml"
    renamed.write_text(verl.read_text().replace('"code_interpreter"', '"python"'))
    m = compose(renamed).actor_rollout_ref.rollout.multi_turn
    assert m.tools == ["python"]
    assert m.tool_kwargs == {"python": {"timeout_s": 30.0, "cpu_time_s": 30, "memory_mb": 1024}}
    out = capsys.readouterr().out
    assert "SandboxFusionTool is hybridrl's python tool" in out and "sandbox_fusion_url" in out
    assert "tool_timeout_s=10 ends each call first" in out
    renamed.write_text(renamed.read_text().replace('default_language: "python"', 'default_language: "cpp"'))
    assert "config.default_language='cpp'" in refusal(renamed)


def test_verls_gsm8k_tool_is_gsm8k_under_verls_function_name(capsys: pytest.CaptureFixture[str]) -> None:
    """verl's own file (its tool_schema's name and parameters are the plugin's; the description is the plugin's)."""
    m = compose(VERL_TOOLS / "gsm8k_tool_config.yaml").actor_rollout_ref.rollout.multi_turn
    assert m.tools == ["gsm8k"] and m.tool_kwargs == {}
    out = capsys.readouterr().out
    assert "verl.tools.gsm8k_tool.Gsm8kTool is hybridrl's gsm8k tool" in out
    assert "extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth" in out
    assert "the policy reads hybridrl's gsm8k description, not the file's" in out


def test_verls_image_zoom_in_tool_is_image_zoom_in_under_verls_schema(capsys: pytest.CaptureFixture[str]) -> None:
    """verl's own file (examples/sglang_multiturn/config/tool_config/image_zoom_in_tool_config.yaml): its tool_schema,
    name and description included, is the plugin's."""
    m = compose(VERL_TOOLS / "image_zoom_in_tool_config.yaml").actor_rollout_ref.rollout.multi_turn
    assert m.tools == ["image_zoom_in"] and m.tool_kwargs == {}
    out = capsys.readouterr().out
    assert "verl.tools.image_zoom_in_tool.ImageZoomInTool is hybridrl's image_zoom_in tool" in out
    assert "description, not the file's" not in out


def test_unknown_classes_and_mcp_are_refused_one_line_each(tmp_path: Path) -> None:
    two = tmp_path / "two.yaml"
    two.write_text("tools:\n  - class_name: my_pkg.tools.Search\n    config: {type: native}\n"
                   "  - class_name: calculator\n    config: {type: mcp}\n")
    with pytest.raises(ConfigError) as e:
        compose(two)
    unknown, mcp = (str(i) for i in e.value.issues)
    assert str(two) in unknown and "tools[0]: class 'my_pkg.tools.Search' is not a hybridrl tool" in unknown
    assert "calculator (hybridrl.tools.calculator.Calculator), gsm8k (hybridrl.tools.gsm8k.Gsm8kTool), image_zoom_in " \
           "(hybridrl.tools.image_zoom.ImageZoomIn), python (hybridrl.tools.python.PythonTool)" in unknown
    assert "verl.tools.gsm8k_tool.Gsm8kTool is hybridrl's gsm8k" in unknown
    assert "tools[1]" in mcp and "MCP" in mcp


def test_a_missing_file_or_bad_yaml_names_the_key_and_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.yaml"
    assert f"{KEY}='{missing}'" in refusal(missing) and "does not exist" in refusal(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools: [class_name: calculator\n")
    assert "cannot be read" in refusal(bad)
    bad.write_text("- class_name: calculator\n")
    assert "has no `tools:` list" in refusal(bad)
