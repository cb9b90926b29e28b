"""The API's conventions that every part of the kubelet writes: timestamps and the terminal pod phases."""

from __future__ import annotations

import datetime as dt

TERMINAL = ("Succeeded", "Failed")


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
