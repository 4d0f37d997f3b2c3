"""The plugin registry against real installed distributions (pip-installed into a temp site dir)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from support.plugins import pip_install, write_dist

from hybridrl.registry import (
    GROUPS,
    PluginConfigError,
    PluginNotFoundError,
    Registry,
    make_plugin_config,
)

REPO = Path(__file__).resolve().parents[1]
_pip_install, _write_dist = pip_install, write_dist


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Site dirs: the example plugin package; a rival claiming a built-in name; a broken one; one whose
    estimators lack the protocol's capability flags."""
    tmp = tmp_path_factory.mktemp("plugins")
    example = tmp / "site_example"
    _pip_install(REPO / "plugins" / "hybridrl-length-reward", example)
    rival_src = _write_dist(tmp / "rival_src", "rival-rewards", "rival_rewards", GROUPS["reward_managers"],
                            {"arithmetic": "rival_rewards:Arith"},
                            """
                            from dataclasses import dataclass
                            class Arith:
                                @dataclass(kw_only=True)
                                class Config:
                                    pass
                            """)
    rival = tmp / "site_rival"
    _pip_install(rival_src, rival)
    broken_src = _write_dist(tmp / "broken_src", "broken-plugin", "broken_plugin", GROUPS["policy_losses"],
                             {"noconfig": "broken_plugin:NoConfig", "crashes": "broken_plugin.missing:X"},
                             "class NoConfig:\n    pass\n")
    broken = tmp / "site_broken"
    _pip_install(broken_src, broken)
    flagless_src = _write_dist(tmp / "flagless_src", "flagless-estimators", "flagless_estimators",
                               GROUPS["advantage_estimators"],
                               {"nocritic": "flagless_estimators:NoCritic", "strflag": "flagless_estimators:StrFlag",
                                "noteacher": "flagless_estimators:NoTeacher",
                                "strteacher": "flagless_estimators:StrTeacher"},
                               """
                               from dataclasses import dataclass
                               class NoCritic:
                                   @dataclass(kw_only=True)
                                   class Config:
                                       pass
                                   needs_group = True
                               class StrFlag(NoCritic):
                                   needs_group = "yes"
                                   needs_critic = False
                               class NoTeacher(NoCritic):
                                   needs_critic = False
                               class StrTeacher(NoTeacher):
                                   needs_teacher = "no"
                               """)
    flagless = tmp / "site_flagless"
    _pip_install(flagless_src, flagless)
    return {"example": example, "rival": rival, "broken": broken, "flagless": flagless}


def _run(code: str, *sites: Path, args: tuple[str, ...] | list[str] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(s) for s in sites)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True,
                          text=True)


@pytest.mark.slow
def test_installed_plugin_appears_in_cli_listing(sites: dict[str, Path]) -> None:
    env = {**os.environ, "PYTHONPATH": str(sites["example"])}
    out = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plugins"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines()]
    assert ["reward_managers", "length", "hybridrl-length-reward", "0.1.0",
            "hybridrl_length_reward:LengthReward"] in rows
    # built-ins come through the same entry-point path, from our own distribution
    assert any(r[:3] == ["advantage_estimators", "grpo", "hybridrl"] for r in rows)


@pytest.mark.slow
def test_plugin_is_loaded_lazily_and_its_config_validated(sites: dict[str, Path]) -> None:
    r = _run("""
        import sys
        from hybridrl.registry import Registry, PluginConfigError, all_entries
        reg = Registry("reward_managers")
        all_entries(); assert "length" in reg.names()
        assert "hybridrl_length_reward" not in sys.modules, "listing must not import plugins"
        cfg = reg.make_config("length", {"target_length": 4}, key="reward.kwargs")
        assert "hybridrl_length_reward" in sys.modules
        assert cfg.target_length == 4 and cfg.scale == 16.0
        try:
            reg.make_config("length", {"target_lenght": 4}, key="reward.kwargs")
        except PluginConfigError as e:
            print(e)
        """, sites["example"])
    assert r.returncode == 0, r.stderr
    assert "unknown key reward.kwargs.target_lenght" in r.stdout
    assert "target_length: int" in r.stdout and "scale: float" in r.stdout  # lists the valid keys


def test_registries_share_one_scan_per_sys_path_and_see_a_new_site(sites: dict[str, Path]) -> None:
    """A run builds ~20 registries; each used to re-read the METADATA of every installed distribution (0.1 s a
    scan here). They now share one scan while ``sys.path`` is unchanged, and a site added to it is seen."""
    r = _run("""
        import sys
        from importlib import metadata
        from hybridrl import registry
        calls = []
        real = metadata.distributions
        metadata.distributions = lambda **kw: calls.append(1) or real(**kw)
        assert "nocritic" not in registry.Registry("advantage_estimators").names()
        for group in registry.GROUPS:
            registry.Registry(group).names()
        registry.all_entries()
        assert len(calls) == 1, calls
        sys.path.insert(0, sys.argv[1])
        assert "nocritic" in registry.Registry("advantage_estimators").names() and len(calls) == 2
        print("ok")
        """, args=[str(sites["flagless"])])
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


def test_same_name_from_two_distributions_names_both(sites: dict[str, Path]) -> None:
    r = _run("""
        from hybridrl.registry import Registry, DuplicatePluginError
        try:
            Registry("reward_managers").load("arithmetic", key="reward.name")
        except DuplicatePluginError as e:
            print(e)
        """, sites["rival"])
    assert r.returncode == 0, r.stderr
    assert "reward.name='arithmetic'" in r.stdout
    assert "hybridrl 0.1.0" in r.stdout and "rival-rewards 9.9.1" in r.stdout


def test_broken_plugins_fail_with_their_distribution_named(sites: dict[str, Path]) -> None:
    r = _run("""
        from hybridrl.registry import Registry, PluginLoadError
        reg = Registry("policy_losses")
        for name in ("noconfig", "crashes"):
            try:
                reg.load(name)
            except PluginLoadError as e:
                print(e)
        """, sites["broken"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "noconfig" in lines[0] and "no nested `Config` dataclass" in lines[0]
    assert "crashes" in lines[1] and "broken-plugin 9.9.1" in lines[1] and "ModuleNotFoundError" in lines[1]


@pytest.mark.slow
def test_missing_capability_flag_names_plugin_distribution_attribute_and_protocol(sites: dict[str, Path]) -> None:
    r = _run("""
        from hybridrl.registry import Registry, PluginError
        reg = Registry("advantage_estimators")
        for name in ("nocritic", "strflag"):
            try:
                reg.load(name, key="algorithm.adv_estimator")
            except PluginError as e:
                print(e)
        print(reg.load("grpo").needs_group)  # built-ins declare theirs
        """, sites["flagless"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for line in lines[:2]:
        assert "flagless-estimators 9.9.1" in line and "AdvantageEstimator protocol" in line, line
        assert "needs_group, needs_critic (each a bool)" in line, line
    assert "plugin 'nocritic'" in lines[0] and "`needs_critic` is missing" in lines[0]
    assert "plugin 'strflag'" in lines[1] and "`needs_group` is 'yes'" in lines[1]
    assert lines[2] == "True"


@pytest.mark.slow
def test_a_flag_with_a_default_may_be_left_out_but_not_mistyped(sites: dict[str, Path]) -> None:
    """``needs_teacher`` (default False in the protocol): an estimator written before it existed still loads, and
    the loop reads the flag as a plain attribute; one that sets it to a non-bool is refused by name."""
    r = _run("""
        from hybridrl.registry import Registry, PluginError
        reg = Registry("advantage_estimators")
        print(reg.load("noteacher").needs_teacher, reg.load("opd").needs_teacher)
        try:
            reg.load("strteacher", key="algorithm.adv_estimator")
        except PluginError as e:
            print(e)
        """, sites["flagless"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "False True"
    assert "plugin 'strteacher'" in lines[1] and "`needs_teacher` is 'no'" in lines[1], lines[1]


@pytest.mark.parametrize("group", GROUPS)
def test_every_installed_plugin_passes_the_load_checks(group: str) -> None:
    reg = Registry(group)
    for name in reg.names():
        reg.load(name)  # a Config dataclass and the protocol's capability flags, built-ins included


def test_unknown_name_lists_installed() -> None:
    with pytest.raises(PluginNotFoundError) as e:
        Registry("advantage_estimators").entry("grpoo", key="algorithm.adv_estimator")
    msg = str(e.value)
    assert msg.startswith("algorithm.adv_estimator='grpoo'")
    assert "grpo" in msg and "rloo" in msg and "gae" in msg


def test_unknown_group() -> None:
    with pytest.raises(ValueError, match="valid: "):
        Registry("reward_manager")


@dataclass(kw_only=True)
class _Cfg:
    alpha: float
    mode: str = "a"
    n: int = 2
    kind: Literal["x", "y"] = "x"
    limit: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("a", "b"):
            raise ValueError(f"mode={self.mode!r}: valid modes are 'a', 'b'")


class _Plugin:
    Config = _Cfg


def test_plugin_config_reports_every_mistake_with_its_key() -> None:
    with pytest.raises(PluginConfigError) as e:
        make_plugin_config(_Plugin, "toy", {"n": "3", "bogus": 1}, key="reward.kwargs")
    msg = str(e.value)
    assert "unknown key reward.kwargs.bogus" in msg
    assert "reward.kwargs.n='3' has type str, expected int" in msg
    assert "missing required key reward.kwargs.alpha" in msg
    assert "Valid keys of 'toy': alpha: float, mode: str, n: int, kind: one of 'x', 'y', limit: float | None" in msg


def test_literal_and_optional_fields() -> None:
    with pytest.raises(PluginConfigError, match=r"kind='z' has type str, expected one of 'x', 'y'"):
        make_plugin_config(_Plugin, "toy", {"alpha": 1, "kind": "z"}, key="k")
    assert make_plugin_config(_Plugin, "toy", {"alpha": 1, "limit": None, "kind": "y"}, key="k").kind == "y"


def test_plugin_config_runs_the_plugins_own_checks() -> None:
    with pytest.raises(PluginConfigError, match="mode='c': valid modes are 'a', 'b'"):
        make_plugin_config(_Plugin, "toy", {"alpha": 1, "mode": "c"}, key="reward.kwargs")
    assert make_plugin_config(_Plugin, "toy", {"alpha": 1}, key="k").alpha == 1  # int accepted as float
