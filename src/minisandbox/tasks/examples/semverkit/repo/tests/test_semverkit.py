from semverkit import is_upgrade, newest_matching


def test_newest_matching_simple():
    assert newest_matching(["1.0", "1.1", "2.0"], "<2") == "1.1"


def test_newest_matching_none():
    assert newest_matching(["1.0"], ">=3") is None


def test_is_upgrade_simple():
    assert is_upgrade("1.0", "1.1")
