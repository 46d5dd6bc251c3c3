"""What a build sandbox may reach: the package indexes and git hosts a build needs, and the
ones the user's own pip and uv settings name; nothing else (sandbox/egress.py enforces it).

The allow-list is PyPI (pypi.org, files.pythonhosted.org, and pypi.python.org, the index pips
before 10 use, which redirects to pypi.org; builds name pypi.org to every pip anyway), GitHub
(github.com and its download hosts: source archives, release assets, raw files), every host of
an index URL in the host's pip or uv settings (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL,
UV_INDEX_URL, UV_EXTRA_INDEX_URL, UV_DEFAULT_INDEX, UV_INDEX, and the index-url /
extra-index-url of pip's configuration files), and whatever $MINISANDBOX_BUILD_HOSTS adds
(names separated by commas or spaces; '.example.org' allows its subdomains too; 'host:port'
allows that port, also on this host's own or private addresses, for an index run locally).
An index the user's settings name by URL is allowed at its host and port, wherever it resolves
(the user chose it). If the host reaches the internet through a proxy (HTTPS_PROXY), the build's
proxy goes through it.
"""

from __future__ import annotations

import configparser
import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from minisandbox.sandbox.egress import EgressPolicy

# What every build may need: PyPI, and GitHub for git dependencies and release downloads
# (uv's managed Pythons come from GitHub releases).
DEFAULT_HOSTS = (
    "pypi.org",
    "files.pythonhosted.org",
    "pypi.python.org",  # pip < 10's default index (an environment dated before April 2018)
    "github.com",
    "codeload.github.com",
    ".githubusercontent.com",
)
_INDEX_VARS = (
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "UV_INDEX_URL",
    "UV_EXTRA_INDEX_URL",
    "UV_DEFAULT_INDEX",
    "UV_INDEX",
)
EXTRA_HOSTS_VAR = "MINISANDBOX_BUILD_HOSTS"
PYPI_SIMPLE = "https://pypi.org/simple/"


def _pip_config_files() -> list[Path]:
    home = Path.home()
    xdg = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    # pip's order (a later file wins): global, then user (legacy first), then the named one.
    files = [Path("/etc/xdg/pip/pip.conf"), Path("/etc/pip.conf"), home / ".pip/pip.conf"]
    files.append(xdg / "pip/pip.conf")
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    return files


def _pip_configs() -> Iterator[configparser.RawConfigParser]:
    """pip's configuration files that parse, in pip's order."""
    for path in _pip_config_files():
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        yield parser


def index_urls() -> list[str]:
    """The index URLs of the host's pip and uv settings (environment and pip's files)."""
    urls: list[str] = []
    for name in _INDEX_VARS:
        for word in os.environ.get(name, "").split():
            urls.append(word.split("=", 1)[1] if re.match(r"^[\w.-]+=", word) else word)
    for parser in _pip_configs():
        for section in parser.sections():
            for key in ("index-url", "extra-index-url", "index_url", "extra_index_url"):
                urls += parser.get(section, key, fallback="").split()
    return urls


def pip_index() -> str:
    """pip's main index as the host's pip would use it: $PIP_INDEX_URL, else the last
    `[global] index-url` of its configuration files, else today's PyPI (never pip's own
    default, which for pips before 10 is pypi.python.org)."""
    if os.environ.get("PIP_INDEX_URL", "").strip():
        return os.environ["PIP_INDEX_URL"].strip()
    found = PYPI_SIMPLE
    for parser in _pip_configs():  # in pip's order: a later file wins
        for key in ("index-url", "index_url"):
            found = parser.get("global", key, fallback="").strip() or found
    return found


def build_policy() -> EgressPolicy:
    """The egress of build sandboxes, from the host's settings now (see the module docstring)."""
    hosts = list(DEFAULT_HOSTS)
    local: list[str] = []
    for url in index_urls():
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            continue  # file:// and paths: bound into the sandbox, no network
        hosts.append(parts.hostname.lower())
        port = parts.port or (443 if parts.scheme == "https" else 80)
        local.append(f"{parts.hostname.lower()}:{port}")
    for word in re.split(r"[\s,]+", os.environ.get(EXTRA_HOSTS_VAR, "")):
        if not word:
            continue
        name, sep, number = word.rpartition(":")
        if sep and number.isdigit():
            local.append(f"{name.lower()}:{number}")
        else:
            hosts.append(word.lower())
    upstream = None
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        if os.environ.get(name, "").startswith("http://"):
            upstream = os.environ[name]
            break
    return EgressPolicy(
        hosts=tuple(dict.fromkeys(hosts)), local=tuple(dict.fromkeys(local)), upstream=upstream
    )
