"""Attacks on the host code around the sandbox (issue: the host never acts on what a sandbox
wrote): registered into attacks.ATTACKS, run as root and as an unprivileged caller by
test_attacks.py like every other attack."""

from __future__ import annotations

from attacks import AttackContext, attack  # noqa: F401
