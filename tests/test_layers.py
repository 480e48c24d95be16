"""The layering rules of moorline (docs/architecture.md, "Layers"), checked on the source (AST):

- the pure layers (``raft``, ``broker``, ``mqtt``, ``storage``) never import ``moorline.node``;
- ``moorline/node/edge`` never imports ``moorline/node/replication`` (the edge reaches replicated
  state through the node's API);
- inside ``moorline/node`` no module reads or calls another module's private name
  (``conn._closing``, ``from x import _helper``);
- outside ``moorline/broker`` only ``moorline/broker/queries.py``'s functions reach a shard state's
  ``regs``, ``owed`` and ``claims``: no attribute of those names is read in ``moorline/node``;
- one composition root: in ``moorline`` only ``moorline/node/assembly.py`` constructs a ``Node``,
  ``MqttServer``, ``Authorizer``, ``SysTopics`` or ``Drain`` (``moorline run`` and the simulator
  build their nodes the same way).

What breaks a rule today is listed below, each with its reason; the lists only shrink: a new
violation fails, and so does an entry that no longer occurs (remove it).
"""

from __future__ import annotations

import ast
from pathlib import Path

MOORLINE = Path(__file__).resolve().parents[1] / "moorline"
NODE = MOORLINE / "node"
PURE_LAYERS = ("raft", "broker", "mqtt", "storage")

# (file under moorline/node, imported module) -> why it is still allowed
EDGE_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
}

# (file under moorline/node, accessed expression) -> why it is still allowed
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {
    ("admin/admin_api.py", "import moorline.node.admin.http_api._err"):
        "the HTTP API's error response helper, shared by the admin routes: to become a public helper",
    ("admin/cluster_admin_api.py", "import moorline.node.admin.http_api._err"): "as above (admin_api.py)",
    ("admin/groups_cli.py", "import moorline.node.admin.cluster_cli._addresses"):
        "the cluster CLI's helpers, shared by the groups CLI: to become public helpers of an admin CLI module",
    ("admin/groups_cli.py", "import moorline.node.admin.cluster_cli._get"): "as above",
    ("admin/http_api.py", "site._server"): "aiohttp's TCPSite has no public accessor for its server",
}

# The shard state's fields node code reaches only through moorline/broker/queries.py.
STATE_FIELDS = ("regs", "owed", "claims")

# (file under moorline/node, accessed expression) -> why it still reads a state field itself
STATE_FIELDS_ALLOWED: dict[tuple[str, str], str] = {
    ("boot.py", "t.regs"): "recovery drops offsets the store lost from every registration's owed, writing the "
        "state outside an apply: boot.py (another engineer's this session) to do it through the broker",
    ("boot.py", "reg.owed"): "as above",
    ("sessions/fanout.py", "fx.claims"): "Effects.claims (what an apply claimed for $share members), not a "
        "registration's field",
}
# Files whose every access is allowed for now: another engineer reworks them this session.
STATE_FIELDS_ALLOWED_FILES: dict[str, str] = {
    "sessions/lifecycle.py": "reconcile / ghost / ack-report code being reworked (issue 29 item 3): to use queries.py",
    "sessions/followups.py": "new this session (issue 29 item 3), being worked on: to use queries.py",
}

# What only the composition root (moorline/node/assembly.py) constructs.
ASSEMBLED = ("Node", "MqttServer", "Authorizer", "SysTopics", "Drain")
COMPOSITION_ROOT = "node/assembly.py"  # relative to moorline/

# Names with a leading underscore that are public API of their library.
NOT_PRIVATE = {"os._exit", "sys._getframe"}


def _rel(path: Path) -> str:
    return path.relative_to(NODE).as_posix()


def _module_of(path: Path) -> str:
    parts = path.relative_to(MOORLINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str) -> set[str]:
    """Every module ``source`` (the text of module ``module``) imports, relative imports resolved;
    ``from pkg import name`` counts as ``pkg`` and ``pkg.name`` (either may be the module)."""
    out: set[str] = set()
    package = module.rsplit(".", 1)[0]
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (n.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in n.names)
    return out


def private_accesses(source: str) -> set[str]:
    """``obj._name`` reads and calls whose ``_name`` this module does not define itself (so it
    belongs to another module's object), and ``from m import _name``; ``self``/``cls`` excluded."""
    tree = ast.parse(source)
    defined: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            defined.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            defined.add(n.id)
        elif isinstance(n, ast.arg):
            defined.add(n.arg)
    found: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            text = f"{ast.unparse(n.value)}.{n.attr}"
            if n.attr not in defined and text not in NOT_PRIVATE:
                found.add(text)
        elif isinstance(n, ast.ImportFrom):
            found.update(f"import {n.module}.{a.name}" for a in n.names
                         if a.name.startswith("_") and not a.name.startswith("__"))
    return found


def state_field_accesses(source: str) -> set[str]:
    """Every attribute read named ``regs``, ``owed`` or ``claims`` (the expression as written)."""
    return {ast.unparse(n) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and n.attr in STATE_FIELDS}


def constructions(source: str) -> set[str]:
    """The ASSEMBLED classes ``source`` calls (``Node(...)``, ``edge.server.MqttServer(...)``)."""
    found = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) else ""
            if name in ASSEMBLED:
                found.add(name)
    return found


def _node_files() -> list[Path]:
    return sorted(p for p in NODE.rglob("*.py") if "__pycache__" not in p.parts)


def test_pure_layers_never_import_the_node() -> None:
    bad = []
    for layer in PURE_LAYERS:
        for path in sorted((MOORLINE / layer).rglob("*.py")):
            mods = imported_modules(path.read_text(), _module_of(path))
            bad += [f"{path.relative_to(MOORLINE)} imports {m}" for m in sorted(mods)
                    if m == "moorline.node" or m.startswith("moorline.node.")]
    assert not bad, "a pure layer imports moorline.node:\n" + "\n".join(bad)


def _edge_imports() -> set[tuple[str, str]]:
    found = set()
    for path in _node_files():
        if _rel(path).startswith("edge/"):
            for m in imported_modules(path.read_text(), _module_of(path)):
                if m.startswith("moorline.node.replication."):
                    found.add((_rel(path), ".".join(m.split(".")[:4])))  # the module, not its names
    return found


def test_edge_never_imports_replication() -> None:
    found = _edge_imports()
    new = sorted(found - set(EDGE_IMPORTS_ALLOWED))
    assert not new, "edge/ imports replication/ (go through the node's API):\n" + "\n".join(map(str, new))
    stale = sorted(set(EDGE_IMPORTS_ALLOWED) - found)
    assert not stale, "no longer imported, remove from EDGE_IMPORTS_ALLOWED:\n" + "\n".join(map(str, stale))


def _private() -> set[tuple[str, str]]:
    return {(_rel(path), text) for path in _node_files() for text in private_accesses(path.read_text())}


def test_no_private_access_across_modules_in_the_node() -> None:
    found = _private()
    new = sorted(found - set(PRIVATE_ALLOWED))
    assert not new, ("a module of moorline/node uses another module's private name (give it a public one):\n"
                     + "\n".join(f"{f}: {t}" for f, t in new))
    stale = sorted(set(PRIVATE_ALLOWED) - found)
    assert not stale, "fixed, remove from PRIVATE_ALLOWED:\n" + "\n".join(f"{f}: {t}" for f, t in stale)


def _state_fields() -> set[tuple[str, str]]:
    return {(_rel(path), text) for path in _node_files() if _rel(path) not in STATE_FIELDS_ALLOWED_FILES
            for text in state_field_accesses(path.read_text())}


def test_only_broker_queries_reach_state_fields() -> None:
    found = _state_fields()
    new = sorted(found - set(STATE_FIELDS_ALLOWED))
    assert not new, ("moorline/node reads a shard state's regs/owed/claims (use moorline/broker/queries.py):\n"
                     + "\n".join(f"{f}: {t}" for f, t in new))
    stale = sorted(set(STATE_FIELDS_ALLOWED) - found)
    assert not stale, "fixed, remove from STATE_FIELDS_ALLOWED:\n" + "\n".join(f"{f}: {t}" for f, t in stale)
    gone = sorted(f for f in STATE_FIELDS_ALLOWED_FILES
                  if not (NODE / f).exists() or not state_field_accesses((NODE / f).read_text()))
    assert not gone, "fixed, remove from STATE_FIELDS_ALLOWED_FILES:\n" + "\n".join(gone)


def test_only_the_composition_root_builds_a_node() -> None:
    bad = []
    for path in sorted(MOORLINE.rglob("*.py")):
        rel = path.relative_to(MOORLINE).as_posix()
        if "__pycache__" not in path.parts and rel != COMPOSITION_ROOT:
            bad += [f"{rel} constructs {name}" for name in sorted(constructions(path.read_text()))]
    assert not bad, f"build nodes through moorline/{COMPOSITION_ROOT} (NodeAssembly):\n" + "\n".join(bad)
    assert constructions((MOORLINE / COMPOSITION_ROOT).read_text()) == set(ASSEMBLED)


def test_the_checks_see_planted_violations() -> None:
    """The scanners themselves: each rule's violation, planted in a snippet, is found."""
    assert "moorline.node.node" in imported_modules("from moorline.node.node import Node\n", "moorline.broker.x")
    assert "moorline.node.replication.shard_host" in imported_modules(
        "from ..replication.shard_host import ShardHost\n", "moorline.node.edge.connection")
    planted = "def f(conn):\n    return conn._closing or live._room()\n"
    assert private_accesses(planted) == {"conn._closing", "live._room"}
    assert private_accesses("from moorline.node.admin.http_api import _err\n") == {
        "import moorline.node.admin.http_api._err"}
    own = "class A:\n    def __init__(self):\n        self._x = 1\n    def g(self, other):\n        return other._x\n"
    assert private_accesses(own) == set()  # a module's own private names, on another instance
    assert private_accesses("import os\nos._exit(1)\n") == set()
    planted_state = "def f(host, reg, o):\n    return host.state.topics.regs.get('k') or o in reg.owed or reg.claims[o]\n"
    assert state_field_accesses(planted_state) == {"host.state.topics.regs", "reg.owed", "reg.claims"}
    assert state_field_accesses("from moorline.broker.queries import owed_after\nx = owed_after(reg, 3)\n") == set()
    planted_root = "node = Node(cfg, faults, seams)\nsrv = server.MqttServer(node, Authorizer(cfg.auth, True))\n"
    assert constructions(planted_root) == {"Node", "MqttServer", "Authorizer"}
    assert constructions("drain = make_drain()\nx: Drain | None = None\n") == set()
