from tablekit import render

ROWS = [("food", "bread", 3), ("food", "milk", 2), ("travel", "bus", 5)]


def test_render_has_total():
    assert "TOTAL" in render(ROWS)
    assert render(ROWS).splitlines()[-1].split()[-1] == "10"
