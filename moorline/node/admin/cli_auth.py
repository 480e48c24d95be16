"""The Authorization header the admin CLIs send (``moorline cluster``, ``moorline groups``)."""

from __future__ import annotations

import base64


def auth_header(user: str | None, password: str | None, token: str | None) -> str | None:
    """From --token (Bearer) or --user/--password (Basic); None when neither is given."""
    if token:
        return f"Bearer {token}"
    if user is not None:
        return "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode()
    return None
