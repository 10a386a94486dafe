"""Every setting is a flag whose help comes from the setting itself, and whose allowed values the parser enforces."""

import dataclasses

import pytest

from fiberserve.cli import main
from fiberserve.config import TOOL_CALL_PARSERS, EngineConfig, ServerConfig

SETTINGS = [f for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls) if f.name != "engine"]


def test_every_setting_describes_itself():
    undescribed = [f.name for f in SETTINGS if len(f.metadata.get("help", "")) < 10]
    assert undescribed == []


def test_the_help_shows_each_settings_own_text_and_default(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    shown = "".join(capsys.readouterr().out.split())  # argparse wraps lines, at hyphens too
    for f in SETTINGS:
        flag = "--" + f.name.replace("_", "-")
        assert flag in shown and "".join(f.metadata["help"].split()) in shown, f.name
    assert "(default:512)" in shown and "{" + ",".join(TOOL_CALL_PARSERS) + "}" in shown
    assert "[--lora-modules[LORA_MODULES...]]" in shown and "[--cors-origins[CORS_ORIGINS...]]" in shown  # lists


@pytest.mark.parametrize(("flag", "value"), [("--dtype", "float16"), ("--log-level", "loud"), ("--isolation", "x")])
def test_a_value_outside_a_settings_choices_is_refused(capsys, flag, value):
    with pytest.raises(SystemExit) as done:
        main(["serve", flag, value])
    assert done.value.code == 2
    assert f"argument {flag}: invalid choice: '{value}'" in capsys.readouterr().err
