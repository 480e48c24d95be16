"""The HTTP API's description holds: every route the node registers is in the OpenAPI table
(moorline/node/admin/openapi.py) and has a section in docs/http-api.md, and neither names a route the
node lacks; each section mentions its route's parameters, body and answer fields and error
statuses; GET /v1/openapi.json serves the document."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from moorline.config import AuthConfig, NodeConfig
from moorline.node.admin.http_api import make_app
from moorline.node.admin.openapi import ROUTES, Route, Schema, openapi_document
from moorline.node.clock import SystemClock
from moorline.node.edge.auth import Authorizer

pytestmark = pytest.mark.timeout(60)
DOC = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"
HEADING = re.compile(r"^### `(GET|POST|PUT|DELETE|PATCH) (/\S+)`\s*$", re.M)


class StandInNode:
    """make_app reads only the configuration while it builds the routes."""

    cfg = NodeConfig()
    clock = SystemClock()  # the console sampler the app builds reads it


def app() -> web.Application:
    return make_app(StandInNode(), Authorizer(AuthConfig(), loopback_only=True), auth_required=False)  # type: ignore[arg-type]


def registered() -> set[tuple[str, str]]:
    out = set()
    for route in app().router.routes():
        if route.method == "HEAD":  # aiohttp adds one to every GET route
            continue
        info = route.resource.get_info() if route.resource is not None else {}
        out.add((route.method.lower(), info.get("path") or info["formatter"]))
    return out


def doc_sections() -> dict[tuple[str, str], str]:
    text = DOC.read_text()
    heads = list(HEADING.finditer(text))
    return {(m.group(1).lower(), m.group(2)): text[m.end(): heads[i + 1].start() if i + 1 < len(heads) else len(text)]
            for i, m in enumerate(heads)}


def test_every_registered_route_is_described_and_nothing_else() -> None:
    table = {(r.method, r.path) for r in ROUTES}
    assert len(table) == len(ROUTES), "a route is in the table twice"
    routes = registered()
    assert routes - table == set(), "routes the node serves that moorline/node/admin/openapi.py lacks"
    assert table - routes == set(), "routes in moorline/node/admin/openapi.py the node does not serve"
    documented = doc_sections()
    assert routes - set(documented) == set(), "routes without a section in docs/http-api.md"
    assert set(documented) - routes == set(), "sections of docs/http-api.md for routes the node does not serve"
    paths = openapi_document()["paths"]
    assert {(m, p) for p, ops in paths.items() for m in ops} == table


def field_names(schema: Schema | None) -> set[str]:
    """Property names of an object schema and of the objects inside it (arrays, nested objects)."""
    if schema is None:
        return set()
    names: set[str] = set()
    for name, sub in schema.get("properties", {}).items():
        names.add(name)
        names |= field_names(sub)
    if "items" in schema:
        names |= field_names(schema["items"])
    return names


def mentioned(name: str, text: str) -> bool:
    return f"`{name}`" in text or f'"{name}"' in text


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r.method.upper()} {r.path}")
def test_the_doc_section_names_what_the_table_says(route: Route) -> None:
    section = doc_sections()[(route.method, route.path)]
    fields = field_names(route.body) | {p.name for p in route.params if p.where != "path"}  # path: in the heading
    for status, (_, schema) in route.responses.items():
        if status < 300:
            fields |= field_names(schema)
    missing = sorted(f for f in fields if not mentioned(f, section))
    assert not missing, f"docs/http-api.md, {route.method.upper()} {route.path}: fields not mentioned: {missing}"
    errors = sorted(s for s in route.responses if s >= 300 and not re.search(rf"\b{s}\b", section))
    assert not errors, f"docs/http-api.md, {route.method.upper()} {route.path}: statuses not mentioned: {errors}"
    access = {"admin": "*admin.*", "caller": "*Any caller", "open_status": "*Open while `auth.http_open_status`"}
    assert section.strip().startswith(access[route.access]), section[:80]


def test_the_document_is_served_and_is_valid_openapi() -> None:
    async def get() -> tuple[int, Any]:
        async with TestClient(TestServer(app())) as client:
            resp = await client.get("/v1/openapi.json")
            return resp.status, await resp.json()

    status, served = asyncio.run(get())
    assert status == 200 and served == openapi_document()
    assert served["openapi"].startswith("3.")
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(served)
