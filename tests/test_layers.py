"""The floors of the code: every import runs down, and no import cycle exists.

Read from the source, every ``import`` counted, a function's own included (only ``if TYPE_CHECKING:`` blocks are
left out: they never run). Three folders, one way: ``precompile`` (what and when) over ``kernels`` (how a kernel
or a library's cache is built, loaded, captured, restored) over ``cache`` (where results live). Inside
``precompile`` three floors: a server room's adapter (its command line, rules, native functions, seals and
signals: ``servers/``), planning over it (config, plan, warm, hook, ledger, the commands), and the plugins a
server loads on top (``servers/plugins.py``, ``servers/<room>/plugin.py``).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"cache": 0, "kernels": 1, "precompile": 2}
ADAPTER, PLANNING, PLUGINS = 0, 1, 2


def modules() -> dict[str, Path]:
    """Every module of the three folders by its dotted name under ``jitwarm`` (a package by its own name)."""
    found = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
            found[".".join(["jitwarm", *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` imports, at any depth of its code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    never = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
             for stmt in node.body for n in ast.walk(stmt)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in never:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            targets = submodules + ([base] if len(submodules) < len(node.names) else [])
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def floor(name: str) -> tuple[int, int]:
    """(folder, floor inside precompile) of a module: the order imports must run down."""
    parts = name.split(".")
    folder = FOLDERS[parts[1]]
    if parts[1] != "precompile":
        return folder, 0
    if parts[2:3] != ["servers"]:
        return folder, PLANNING
    return folder, PLUGINS if parts[-1] in ("plugins", "plugin") else ADAPTER


def test_every_import_runs_down_the_folders_and_the_floors():
    up = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets if floor(b) > floor(a))
    assert up == [], "\n".join(up)


def test_there_is_no_import_cycle():
    edges = graph()
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    assert cycles == [], cycles


def test_the_graph_is_read_from_every_module():
    """The analysis itself: it sees the modules and their imports, lazy ones too (a check of nothing passes)."""
    edges = graph()
    assert len(edges) > 80
    assert "jitwarm.precompile.config" in edges["jitwarm.precompile.plan"]
    assert "jitwarm.precompile.warming" in edges["jitwarm.precompile.shipping"]  # imported inside cmd_warm
    assert floor("jitwarm.precompile.servers.sglang.plugin") > floor("jitwarm.precompile.ledger") \
        > floor("jitwarm.precompile.servers.sglang.rules") > floor("jitwarm.kernels.backend") \
        > floor("jitwarm.cache.entry")


def test_a_command_calls_no_other_command():
    """``warm``, ``status``, ``verify`` and ``prestart`` share their helpers through :mod:`coverage` (the plan in the
    cache) and :mod:`handover` (what a node receives), which import no command module: a walk of a command's
    arguments goes down into a helper and back, never into another command's module and back out."""
    edges = graph()
    commands = {f"jitwarm.precompile.{m}" for m in ("commands", "shipping", "prestart")}
    for name in commands:
        assert edges[name] & commands == set(), name
    for helper in ("coverage", "handover"):
        assert edges[f"jitwarm.precompile.{helper}"] & (commands | {"jitwarm.precompile.capture"}) == set(), helper
    assert {"jitwarm.precompile.coverage", "jitwarm.precompile.handover"} <= edges["jitwarm.precompile.prestart"]


def test_the_exit_codes_are_one_table():
    """Only cache/errors.py gives an error class its exit code; every other error takes one by deriving from a
    class of that table, and the CLI exits with it (docs/deployment.md, "Exit codes")."""
    from jitwarm.cache import errors

    table = {errors.JitwarmError: 1, errors.UsageError: 2, errors.TimedOut: 3, errors.Refused: 4, errors.NotReady: 5}
    assert {cls: cls.exit_code for cls in table} == table
    assigned = sorted(f"{path.relative_to(ROOT)}:{node.lineno}" for path in modules().values()
                      for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                      if isinstance(node, (ast.Assign, ast.AnnAssign))
                      and "exit_code" in ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
                      and path.name != "errors.py")
    assert assigned == [], assigned
    from jitwarm.cache.signing import UntrustedEntry
    from jitwarm.precompile.hook import KernelLoadFailed, KernelsNotReady, WarmTimeout

    codes = {cls.__name__: cls.exit_code for cls in (errors.LockTimeout, errors.UntrustedPath, errors.RootNotWritable,
                                                     UntrustedEntry, KernelsNotReady, WarmTimeout, KernelLoadFailed)}
    assert codes == {"LockTimeout": 3, "UntrustedPath": 2, "RootNotWritable": 2, "UntrustedEntry": 4,
                     "KernelsNotReady": 5, "WarmTimeout": 3, "KernelLoadFailed": 1}


def test_every_public_error_has_the_one_root():
    """An exception class a caller can catch derives from ``JitwarmError``; the only others are control flow kept
    inside their room (the remote tier's ``RemoteFailure`` and its kinds, the bundle reader's ``HeaderRefused``),
    private, or an interrupt (capture's ``Interrupted`` is a ``KeyboardInterrupt``: exit 130)."""
    from jitwarm.cache.errors import JitwarmError
    from jitwarm.kernels.dispatch import CompileDuringCaptureError

    assert issubclass(CompileDuringCaptureError, JitwarmError) and issubclass(CompileDuringCaptureError, RuntimeError)
    assert CompileDuringCaptureError("kernel k").exit_code == 1
    from jitwarm.cache.remote.base import RemoteFailure

    internal = (RemoteFailure, KeyboardInterrupt, JitwarmError)
    outside = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            module = __import__(name, fromlist=["_"])
            cls = getattr(module, node.name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, internal) \
                    and cls.__name__ != "HeaderRefused":
                outside.append(f"{name}.{node.name}")
    assert outside == [], outside
    from jitwarm.cache import remote

    assert "RemoteFailure" not in remote.__all__


def test_kernels_names_no_variable_a_server_room_reads_for_its_caches():
    """A server room tells a library room where its caches are: every variable a room's ``cache_dirs`` reads
    (sglang's ``SGLANG_CACHE_DIR``, vLLM's ``VLLM_CACHE_ROOT``, ...) is absent from ``kernels/``, code and prose."""
    from collections.abc import Mapping

    from jitwarm.precompile import servers

    class Reads(Mapping):
        def __init__(self):
            self.names = set()

        def __getitem__(self, key):
            self.names.add(key)
            raise KeyError(key)

        def get(self, key, default=None):
            self.names.add(key)
            return default

        def __iter__(self):
            return iter(())

        def __len__(self):
            return 0

    read = Reads()
    for room in servers.ROOMS:
        assert servers.adapter(room).cache_dirs(read)  # every room places some cache
    assert {"SGLANG_CACHE_DIR", "VLLM_CACHE_ROOT"} <= read.names  # the probe sees what the rooms read
    named = sorted(f"{path.relative_to(ROOT)}: {var}" for path in (ROOT / "kernels").rglob("*.py")
                   for var in read.names if var in path.read_text(encoding="utf-8"))
    assert named == [], named
