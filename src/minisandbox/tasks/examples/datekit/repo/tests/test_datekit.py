from datekit import days_between, next_billing_date


def test_next_billing_date_same_day():
    assert next_billing_date("2024-01-15", 1) == "2024-02-15"


def test_next_billing_date_crosses_year():
    assert next_billing_date("2024-11-10", 3) == "2025-02-10"


def test_days_between():
    assert days_between("2024-02-28", "2024-03-01") == 2
