"""Test services in real task sandboxes (network off), and the recipe overrides naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minisandbox.envs.recipe import EnvRecipe
from minisandbox.envs.tools import tools_interpreter, tools_ref
from minisandbox.errors import ServiceError
from minisandbox.evaluation.services import start_services
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import (
    TaskFormatError,
    apply_recipe_overrides,
    load_recipe_overrides,
    load_tasks,
    recipe_overrides,
    version_matches,
)
from minisandbox.tasks.service_specs import check_services

# Prints what a GET of $HTTPBIN_URL<path> answered: the status, then the body.
_GET = (
    "import os, sys, urllib.request, urllib.error\n"
    "try:\n"
    "    r = urllib.request.urlopen(os.environ['HTTPBIN_URL'] + sys.argv[1], timeout=10)\n"
    "except urllib.error.HTTPError as e:\n"
    "    r = e\n"
    "print(r.status); print(r.read().decode())\n"
)
# How a connection to an unroutable address ends: "timeout" or the errno.
_CONNECT = (
    "import socket\n"
    "s = socket.socket(); s.settimeout(0.5)\n"
    "try:\n"
    "    s.connect(('10.255.255.1', 80)); print('connected')\n"
    "except socket.timeout:\n"
    "    print('timeout')\n"
    "except OSError as e:\n"
    "    print(e.errno)\n"
)


# As httpbin.org answered old requests' tests: a chunked body read, and keep-alive unless the
# request asks to close (requests 0.14's test_file_post_data, test_connection_keepalive_and_close).
_FRONT = (
    "import http.client, os, sys\n"
    "host, port = os.environ['HTTPBIN_URL'].split('//')[1].rstrip('/').split(':')\n"
    "c = http.client.HTTPConnection(host, int(port), timeout=10)\n"
    "c.request('POST', '/post', body=iter([b'abc', b'def']), encode_chunked=True,\n"
    "          headers={'Content-Type': 'application/octet-stream'})\n"
    "r = c.getresponse()\n"
    "print(r.status, r.getheader('Connection'), r.read().count(b'abcdef'))\n"
    "c.request('POST', '/status/200', body=b'unread')\n"  # kept alive: the same connection
    "r = c.getresponse()\n"
    "print(r.status, r.getheader('Connection'), r.read())\n"
    "c.request('GET', '/get', headers={'Connection': 'close'})\n"
    "r = c.getresponse()\n"
    "print(r.status, r.getheader('Connection'))\n"
)


async def test_httpbin_and_tarpit_in_a_task_sandbox(
    settings: BuildSettings, built: list, tmp_path: Path
) -> None:
    builder = Builder(settings)
    task = load_tasks("examples")[0]
    task = task.model_copy(update={"services": ["httpbin", "tarpit"]})
    async with builder.sandbox(task) as sb:
        # The tools environment is a lower layer the task's venv does not see.
        own = await sb.execute("python -c 'import flask' 2>&1")
        assert own.exit_code != 0
        await sb.write_file("/tmp/get.py", _GET)
        await sb.write_file("/tmp/connect.py", _CONNECT)
        async with start_services(sb, task) as env:
            url = env["HTTPBIN_URL"]
            assert url.startswith("http://127.0.0.1:") and url.endswith("/")
            r = await sb.execute(["python", "/tmp/get.py", "get?x=1"], env=env)
            status, body = r.stdout.split("\n", 1)
            assert status == "200", r
            assert json.loads(body)["args"] == {"x": "1"}
            r = await sb.execute(["python", "/tmp/get.py", "digest-auth/auth/u/p"], env=env)
            assert r.stdout.split("\n", 1)[0] == "401"
            await sb.write_file("/tmp/front.py", _FRONT)
            r = await sb.execute(["python", "/tmp/front.py"], env=env)
            lines = ["200 keep-alive 1", "200 keep-alive b''", "200 close"]
            assert r.stdout.splitlines() == lines, r
            # Unroutable: the connection hangs until the client gives up, as on a real network.
            assert (await sb.execute(["python", "/tmp/connect.py"])).stdout.strip() == "timeout"
        # Stopped with the block.
        r = await sb.execute(["python", "/tmp/get.py", "get"], env=env)
        assert r.exit_code != 0 and "refused" in r.stdout + r.stderr
    # Built once: the store names it, a second sandbox reuses it.
    assert builder.store.resolve(tools_ref("httpbin", tools_interpreter()))


# GETs a URL through the task's Python, trusting only the CA bundle named second.
_GET_TLS = (
    "import ssl, sys, urllib.request\n"
    "context = ssl.create_default_context(cafile=sys.argv[2])\n"
    "with urllib.request.urlopen(sys.argv[1], timeout=10, context=context) as r:\n"
    "    print(r.status, r.read().decode())\n"
)


async def test_httpbin_as_public_hosts_over_http_and_https(
    settings: BuildSettings, built: list
) -> None:
    task = load_tasks("examples")[0]
    task = task.model_copy(update={"services": ["httpbin:example.test,www.example.test"]})
    async with Builder(settings).sandbox(task) as sb:
        # A CA bundle the suite would verify against (requests vendors one as cacert.pem).
        await sb.write_file("/testbed/vendored/cacert.pem", "")
        await sb.write_file("/tmp/get.py", _GET)
        await sb.write_file("/tmp/get_tls.py", _GET_TLS)
        async with start_services(sb, task) as env:
            assert env == {"HTTPBIN_URL": "http://example.test/"}
            r = await sb.execute(["python", "/tmp/get.py", "get"], env=env)
            assert r.stdout.split("\n", 1)[0] == "200", r
            assert json.loads(r.stdout.split("\n", 1)[1])["url"] == "http://example.test/get"
            bundle = "/testbed/vendored/cacert.pem"
            for url in ("https://example.test/get", "https://www.example.test/status/200"):
                r = await sb.execute(["python", "/tmp/get_tls.py", url, bundle])
                assert r.exit_code == 0 and r.stdout.startswith("200"), r
            # Only the names asked for: others still do not resolve.
            r = await sb.execute("getent hosts other.example.test")
            assert r.exit_code != 0
        # The bundle is as it was; the suite's own TLS trust is back to what it ships.
        assert (await sb.execute(["cat", "/testbed/vendored/cacert.pem"])).stdout == ""


# GETs a URL (trusting the CA bundle named second): the status, the Content-Type, the size.
_GET_FILE = (
    "import ssl, sys, urllib.error, urllib.request\n"
    "context = ssl.create_default_context(cafile=sys.argv[2])\n"
    "try:\n"
    "    r = urllib.request.urlopen(sys.argv[1], timeout=10, context=context)\n"
    "except urllib.error.HTTPError as e:\n"
    "    r = e\n"
    "print(r.status, r.headers.get('Content-Type'), len(r.read()))\n"
)


async def test_web_serves_the_files_of_public_hosts(settings: BuildSettings, built: list) -> None:
    """sphinx's remote-image test: python.org's logo downloads (a stand-in PNG the package
    holds), any other path of those hosts is 404, over HTTPS the task trusts and over HTTP."""
    task = load_tasks("examples")[0]
    task = task.model_copy(update={"services": ["web:www.python.org,www.google.com"]})
    async with Builder(settings).sandbox(task) as sb:
        await sb.write_file("/testbed/vendored/cacert.pem", "")
        await sb.write_file("/tmp/get.py", _GET_FILE)
        bundle = "/testbed/vendored/cacert.pem"
        logo = "https://www.python.org/static/img/python-logo.png"
        async with start_services(sb, task) as env:
            assert env == {}
            r = await sb.execute(["python", "/tmp/get.py", logo, bundle])
            assert r.stdout.split()[:2] == ["200", "image/png"], r
            r = await sb.execute(["python", "/tmp/get.py", "https://www.google.com/", bundle])
            assert r.stdout.split()[:2] == ["200", "text/html"], r  # a directory: index.html
            for url in (
                "https://www.google.com/NOT_EXIST.PNG",
                "http://www.python.org/static/img/" + "../" * 12 + "etc/passwd",
                "http://www.google.com/static/img/python-logo.png",  # another host's file
            ):
                r = await sb.execute(["python", "/tmp/get.py", url, bundle])
                assert r.stdout.split()[0] == "404", (url, r)
        r = await sb.execute(["python", "/tmp/get.py", logo, bundle])
        assert r.exit_code != 0  # stopped with the block: the name no longer answers
    # Names are checked before anything is read: no path out of data/web/, no unknown host,
    # and one service answering as public hosts.
    for services, why in [
        (["web:.."], "not a host name"),
        (["web:../../../../etc"], "not a host name"),
        (["web:www.example.org"], "no files for www.example.org"),
        (["httpbin:httpbin.org", "web:www.python.org"], "both answer as public hosts"),
    ]:
        bad = task.model_copy(update={"services": services})
        with pytest.raises(ServiceError, match=why):
            check_services(bad)


async def test_without_tarpit_unroutable_fails_at_once(
    settings: BuildSettings, built: list
) -> None:
    task = load_tasks("examples")[0]
    async with Builder(settings).sandbox(task) as sb:
        await sb.write_file("/tmp/connect.py", _CONNECT)
        r = await sb.execute(["python", "/tmp/connect.py"])
        assert r.stdout.strip() == "101"  # ENETUNREACH: no route at all
        async with start_services(sb, task) as env:
            assert env == {}


async def test_unknown_service_is_refused(settings: BuildSettings, built: list) -> None:
    task = load_tasks("examples")[0].model_copy(update={"services": ["smtp:example.test"]})
    with pytest.raises(ServiceError, match=r"unknown service 'smtp:example\.test'"):
        async with Builder(settings).sandbox(task):
            pass


# ---------------------------------------------------------------- recipe overrides


@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [
        ("2.0", "2.0", True),
        ("2.0", "2", True),
        ("2.3", "<2.9", True),
        ("2.10", "<2.9", False),
        ("2.26", ">=2.9,<3", True),
        ("1.1", ">=2.0", False),
        ("0.14", "!=0.14", False),
        ("dev", "<2.9", False),
    ],
)
def test_version_matches(version: str, spec: str, expected: bool) -> None:
    assert version_matches(version, spec) is expected


def test_overrides_pin_drop_env_services(tmp_path: Path) -> None:
    path = tmp_path / "overrides.yaml"
    path.write_text(
        "overrides:\n"
        "  - repo: o/r\n"
        "    version: '<2'\n"
        "    pins: {Foo_Bar: foo-bar==2.0, baz: baz>=1}\n"
        "    drop: [gone]\n"
        "    env: {X: '1'}\n"
        "    services: [httpbin]\n"
        "  - repo: o/r\n"
        "    services: [tarpit, httpbin]\n"
        "  - repo: other/r\n"
        "    pins: {foo-bar: foo-bar==9}\n"
    )
    overrides = load_recipe_overrides(path)
    recipe = EnvRecipe(python="3.9", requirements=["foo.bar==1.0", "gone==1", "x==1"])
    out, services = apply_recipe_overrides("o/r", "1.5", recipe, overrides)
    assert out.requirements == ["foo-bar==2.0", "x==1", "baz>=1"]
    assert out.env == {"X": "1"}
    assert services == ["httpbin", "tarpit"]
    assert any("foo.bar==1.0 -> foo-bar==2.0" in note for note in out.skipped)
    # Another version: only the entry without a version applies; the key changes with pins only.
    out, services = apply_recipe_overrides("o/r", "2.1", recipe, overrides)
    assert out.requirements == recipe.requirements and services == ["tarpit", "httpbin"]
    assert out.key("3.9.1") == recipe.key("3.9.1")


def test_malformed_overrides_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("overrides:\n  - repo: o/r\n    version: 'about 2'\n")
    with pytest.raises(TaskFormatError, match="version"):
        load_recipe_overrides(path)
    path.write_text("overrides:\n  - repo: o/r\n    instance_id: o__r-1\n")
    with pytest.raises(TaskFormatError, match="instance_id"):
        load_recipe_overrides(path)


_TEST_PATCH = "diff --git a/t.py b/t.py\n--- a/t.py\n+++ b/t.py\n@@ -1 +1 @@\n-a\n+b\n"


def test_swebench_loader_applies_the_bundled_overrides(tmp_path: Path) -> None:
    assert any(o.repo == "psf/requests" for o in recipe_overrides())
    records = [
        {
            "instance_id": f"psf__requests-{n}",
            "repo": "psf/requests",
            "version": version,
            "base_commit": "0" * 40,
            "test_patch": _TEST_PATCH,
            "FAIL_TO_PASS": "[]",
            "PASS_TO_PASS": "[]",
            "environment_setup_commit": "0" * 40,
        }
        for n, version in ((1, "2.0"), (2, "2.26"))
    ] + [
        {
            "instance_id": "pallets__flask-1",
            "repo": "pallets/flask",
            "version": "2.3",
            "base_commit": "0" * 40,
            "test_patch": _TEST_PATCH,
            "FAIL_TO_PASS": "[]",
            "environment_setup_commit": "0" * 40,
        }
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    old, new, flask = load_tasks(path)
    assert old.services == ["httpbin:httpbin.org,www.google.co.uk", "tarpit"]
    assert new.services == ["tarpit"]
    assert flask.services == []
