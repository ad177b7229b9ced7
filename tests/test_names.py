"""One source for each shared list: the Python names are the ones the CLI offers and the C strings
the shim's plan parser (shim/src/plan.c) accepts, read here from the source text."""

from __future__ import annotations

import re
from pathlib import Path

import click

from mucudnn import cli
from mucudnn.engines import API_CHOICES, Api
from mucudnn.plan import POLICIES, STRATEGIES
from mucudnn.policy import Policy

PLAN_C = Path(__file__).resolve().parent.parent / "shim" / "src" / "plan.c"


def _plan_c_case(label: str) -> list[str]:
    """The strings the ``case <label>:`` of plan.c's parse_header accepts: those its test before
    ``return fail`` compares the value with."""
    text = PLAN_C.read_text()
    start = text.index(f"case {label}:")
    body = text[start:text.index("return fail", start)]
    return re.findall(r'strcmp\(value, "([^"]*)"\)', body)


def test_plan_c_policies_are_the_python_ones():
    assert _plan_c_case("HEADER_POLICY") == list(POLICIES) == [p.value for p in Policy]


def test_plan_c_strategies_are_the_python_ones():
    assert _plan_c_case("HEADER_STRATEGY") == list(STRATEGIES)


def _choices(command: str, option: str) -> list[str]:
    params = {p.name: p for p in cli.main.commands[command].params}
    assert isinstance(params[option].type, click.Choice)
    return list(params[option].type.choices)


def test_cli_offers_the_one_policy_and_api_list():
    for command in ("bench", "tune", "autotune"):
        assert _choices(command, "policy") == list(POLICIES)
        assert _choices(command, "api") == list(API_CHOICES)
    assert set(API_CHOICES) == {a.value for a in Api} | {"both"}
