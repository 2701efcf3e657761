"""The install story: every extra that names a GPU engine is bounded on both sides, and the pins of
each constraints file satisfy the bounds of the extras it is meant for (so the documented install
commands can resolve)."""
from __future__ import annotations

import os

import pytest
from packaging.requirements import Requirement

from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

CONSTRAINTS = {  # file -> extras installed with it (README, "Installing on GPU machines")
    "constraints-cpu.txt": ("vllm-cpu", "megatron", "lora"),
    "constraints-cuda.txt": ("vllm", "megatron", "cuda"),
    "constraints-cuda-sglang.txt": ("sglang", "megatron", "cuda"),
}


def _pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _pins(name: str) -> dict[str, str]:
    pins = {}
    with open(os.path.join(REPO, "requirements", name), encoding="utf-8") as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                req = Requirement(line)
                (spec,) = req.specifier
                assert spec.operator == "==", line
                pins[req.name] = spec.version
    return pins


@pytest.mark.parametrize("extra", ["vllm", "sglang", "megatron"])
def test_engine_extras_are_bounded_on_both_sides(extra):
    for line in _pyproject()["project"]["optional-dependencies"][extra]:
        ops = {s.operator for s in Requirement(line).specifier}
        assert ops & {">=", ">", "=="} and ops & {"<", "<=", "==", "~="}, line


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_pins_satisfy_the_extras(name):
    project = _pyproject()["project"]
    pins = _pins(name)
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in CONSTRAINTS[name]:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    checked = 0
    for req in reqs:
        if req.name in pins:
            assert req.specifier.contains(pins[req.name], prereleases=True), (name, str(req), pins[req.name])
            checked += 1
    assert checked >= 2, name
