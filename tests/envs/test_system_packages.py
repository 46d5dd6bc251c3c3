"""System packages a task's official image installs with apt: named in its build result when
this host, whose /usr its sandboxes use, lacks them."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from minisandbox.envs.system_packages import apt_packages, missing_on_host
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a dpkg host")


def test_apt_install_commands_name_their_packages() -> None:
    commands = [
        "pre_install: apt-get update && apt-get install -y graphviz",
        "pre_install: apt-get -y update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
        "imagemagick ffmpeg; echo done",
        "pre_install: apt install --no-install-recommends locales",
        "pre_install: sed -i 's/pytest/pytest -rA/' tox.ini",
    ]
    assert apt_packages(commands) == ["graphviz", "imagemagick", "ffmpeg", "locales"]
    tricky = ["apt-get install -y -o Dpkg::Options::=--force-confold tk=8.6 libx/bookworm >/x"]
    assert apt_packages(tricky) == ["tk", "libx"]


@needs_dpkg
def test_missing_packages_are_those_dpkg_lacks() -> None:
    assert missing_on_host(["dpkg", "no-such-package-xyz"]) == ["no-such-package-xyz"]
    assert missing_on_host([]) == []


@needs_dpkg
def test_a_build_warns_of_the_system_packages_the_host_lacks(
    settings: BuildSettings, built: list
) -> None:
    example = load_tasks("examples")[0]
    env = example.env.model_copy(
        update={"skipped": ["pre_install: apt-get install -y dpkg no-such-package-xyz"]}
    )
    result = asyncio.run(Builder(settings).build(example.model_copy(update={"env": env})))
    assert result.status != "failed", result.error
    assert len(result.warnings) == 1 and "no-such-package-xyz" in result.warnings[0]
    assert "dpkg" not in result.warnings[0].split(":")[1]  # installed: not named
    assert asyncio.run(Builder(settings).build(example)).warnings == []
