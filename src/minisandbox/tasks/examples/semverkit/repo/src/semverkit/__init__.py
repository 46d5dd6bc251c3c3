"""Pick the newest release of a package that satisfies a requirement."""

from packaging.specifiers import SpecifierSet


def newest_matching(versions, spec):
    """Return the newest version in `versions` allowed by `spec` (e.g. ">=1.2,<2"), or None."""
    allowed = [v for v in versions if v in SpecifierSet(spec)]
    if not allowed:
        return None
    return max(allowed)


def is_upgrade(current, candidate):
    """True when `candidate` is a newer release than `current`."""
    return candidate > current
