"""Billing-date arithmetic."""

import datetime as dt

from dateutil.parser import isoparse


def next_billing_date(start, months):
    """The date `months` months after `start` (an ISO date string), as an ISO date string.

    Billing on the 31st of a month falls on the last day of shorter months."""
    day = isoparse(start).date()
    month_index = day.month - 1 + months
    year = day.year + month_index // 12
    month = month_index % 12 + 1
    return dt.date(year, month, day.day).isoformat()


def days_between(a, b):
    """Whole days from ISO date `a` to ISO date `b`."""
    return (isoparse(b).date() - isoparse(a).date()).days
