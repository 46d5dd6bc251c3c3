"""A sandbox with an egress policy: no network of its own but a proxy that reaches the hosts
the policy allows and nothing else (sandbox/egress.py), with real sandboxes and real servers
on the host's loopback."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from minisandbox import Sandbox, SandboxConfig
from minisandbox.sandbox.egress import EgressPolicy


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello from the host\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def host_server() -> Iterator[int]:
    """An HTTP server on the host's 127.0.0.1 only: its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def _curl(url: str) -> str:
    return f"curl -sS --max-time 20 -o /dev/null -w '%{{http_code}}' {url} 2>&1; echo"


async def test_only_allowed_hosts_pass(host_server: int) -> None:
    policy = EgressPolicy(hosts=("pypi.org",))
    async with Sandbox(SandboxConfig(egress=policy)) as sb:
        allowed = await sb.execute(_curl("https://pypi.org/simple/pip/"), timeout=120)
        assert allowed.stdout.strip().endswith("200"), f"the allowed host failed: {allowed}"
        for url in (
            "https://example.com/",
            f"http://127.0.0.1:{host_server}/",  # direct: the sandbox's own loopback
            "http://169.254.169.254/latest/meta-data/",
        ):
            r = await sb.execute(_curl(url), timeout=60)
            assert "hello from the host" not in r.stdout and not r.stdout.strip().endswith("200"), (
                f"{url} passed: {r.stdout}"
            )
        forced = await sb.execute(
            f"curl -sS --max-time 20 --noproxy '' -x http://127.0.0.1:3128 "
            f"http://127.0.0.1:{host_server}/"
            " 2>&1; echo",
            timeout=60,
        )
        assert "hello from the host" not in forced.stdout, forced.stdout
        assert "egress to 127.0.0.1" in forced.stdout, forced.stdout  # the proxy's 403 body
        assert any(e.startswith("example.com:443") for e in sb.egress_refused), sb.egress_refused


async def test_a_local_index_the_policy_names_passes(host_server: int) -> None:
    """A host:port in `local` (a user's own index on this host) is reached through the proxy,
    its loopback address notwithstanding; another port of the same address is not."""
    policy = EgressPolicy(hosts=(), local=(f"127.0.0.1:{host_server}",))
    async with Sandbox(SandboxConfig(egress=policy)) as sb:
        r = await sb.execute(f"curl -sS --max-time 20 http://127.0.0.1:{host_server}/", timeout=60)
        assert r.stdout == "hello from the host\n", r.output
        r = await sb.execute(_curl(f"http://127.0.0.1:{host_server + 1}/"), timeout=60)
        assert r.stdout.strip().endswith("403"), r.output


def test_egress_and_the_host_network_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="egress"):
        SandboxConfig(network=True, egress=EgressPolicy(hosts=("pypi.org",)))


def test_policy_names_and_ports() -> None:
    policy = EgressPolicy(hosts=("pypi.org", ".githubusercontent.com"), local=("10.0.0.5:3141",))
    assert policy.allows("pypi.org", 443) and policy.allows("PyPI.org.", 443)
    assert policy.allows("objects.githubusercontent.com", 443)
    assert not policy.allows("evilgithubusercontent.com", 443)
    assert not policy.allows("pypi.org", 22) and not policy.allows("pypi.org.evil.com", 443)
    assert policy.allows("10.0.0.5", 3141) and not policy.allows("10.0.0.5", 80)


async def test_a_connection_open_at_stop_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """A build step that ends with a request in flight through the proxy: closing the proxy
    cancels the connection's task, which asyncio's server callback (3.11) logged as an ERROR
    with a CancelledError traceback after builds. The host side alone, on a real socket."""
    import asyncio
    import logging
    import socket

    from minisandbox.sandbox.egress import EgressProxy

    caplog.set_level(logging.ERROR, logger="asyncio")
    listener = socket.create_server(("127.0.0.1", 0))
    proxy = EgressProxy(EgressPolicy(hosts=("pypi.org",)), listener, "test")
    await proxy.start()
    _reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
    writer.write(b"CONNECT pypi.org:443 HTTP/1.1\r\n")  # a head that never ends
    await writer.drain()
    for _ in range(100):  # until the proxy's task waits on the rest of the head
        if proxy._tasks:
            break
        await asyncio.sleep(0.05)
    assert proxy._tasks, "the proxy never took the connection (positive control)"
    await proxy.close()
    await asyncio.sleep(0.1)  # the done-callbacks run on the next turns
    writer.close()
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert not errors, errors
