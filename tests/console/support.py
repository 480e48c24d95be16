"""HTTP and credentials helpers for the console tests."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from moorline.node.edge.credentials import set_password

REPO_ROOT = Path(__file__).resolve().parents[2]
USERS = {"root": "root-pass", "alice": "alice-pass", "bob": "bob-pass"}  # root has the admin role


def basic(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{USERS[user]}".encode()).decode()


def write_passwords(path: Path) -> None:
    for user, password in USERS.items():
        set_password(path, user, password)


def auth_config(passwords: Path, extra: str = "") -> str:
    return (f'[auth]\nallow_anonymous = false\npassword_file = "{passwords}"\nadmin_users = ["root"]\n'
            f"max_failed_logins = 1000\n{extra}")


def call(base: str, method: str, path: str, user: str | None = None, timeout: float = 15.0) -> tuple[int, Any]:
    headers = {"Authorization": basic(user)} if user else {}
    req = urllib.request.Request(base + path, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")
