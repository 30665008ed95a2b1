"""The import graph, read from the source with ast (nothing is imported or executed).

It fails on an import circle, on an arrow running up the runtime's layers (server → engine →
structured → models → layers → loader/quant/distributed → kernels), on an arrow running up the
operator's (commands → handlers → background → what acts on a service → context → the edges → pure
decisions → config; the router over the pure decisions alone), and on any import between kaon_runtime
and kaon_operator: the operator image carries no torch and no engine, and the engine image
needs no operator. Imports inside functions count: a lazy import is still an arrow.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = (ROOT / "runtime", ROOT / "operator")

# The runtime's layers, top first. A module may import its own layer's modules and any layer below;
# not one above, nor a sibling in its own tier. The leaves (config, sampling, errors, arith) are below everything.
TIERS: tuple[tuple[str, ...], ...] = (
    ("kaon_runtime", "cli"),  # the package's facade (LLM, SamplingParams) and the `kaon` command
    ("server", "llm", "fetch"),
    ("engine",),
    ("structured",),  # grammar-constrained decoding and tool calls: the engine masks with it, the server parses
    ("models",),
    ("layers",),
    ("loader", "quant", "distributed"),
    ("kernels",),
    ("config", "sampling", "lora"),  # lora: vLLM's LoRARequest, a leaf the facade (llm) takes
    ("errors", "arith", "version"),
)
TIER = {part: depth for depth, parts in enumerate(TIERS) for part in parts}
# The operator's layers, top first (modules relative to kaon_operator). A module imports its own
# layer and the layers below it, never one above: the pure decisions (renderers, policies, status
# builders) know nothing of the API, kopf or a clock, so each is a unit test, and the configuration
# is plain values the configured code imports. The router (its own command) imports the operator's
# pure decisions alone; the operator never imports the router.
OPERATOR_TIERS: tuple[tuple[str, ...], ...] = (
    ("__main__", "main", "crd", "reference", "routes.crd"),  # the commands
    ("handlers",),  # kopf registrations
    ("background",),  # the long-running tasks
    # what acts on a service
    ("reconciler", "children.drift", "status.status_sync", "autoscaling.autoscale_loop", "autoscaling.profile_sync",
     "lora.adapter_sync", "autoscaling.standby_sync", "autoscaling.pressure_sync", "key_digests"),
    ("context",),  # what they share
    ("kube", "caches", "records", "watching", "status.status_queue", "autoscaling.scraper", "metrics"),  # the edges
    # pure decisions, with the leaves they share (names, stamps, URLs; the clock is the edges' seam, the router's too)
    ("api", "api_status", "labels", "kubetime", "naming", "spec_policy", "urls", "clock",
     "children.resources", "children.pod_template", "children.leaderworkerset", "children.changes",
     "children.ownership", "children.prefill_pool", "children.disagg_args", "children.kv_cache_args",
     "children.node_prefetch",
     "status.prefill_status",
     "status.conditions", "status.summaries", "lora.adapters", "lora.adapter_pods",
     "autoscaling.autoscaler", "autoscaling.predictive", "autoscaling.demand", "autoscaling.model_bias",
     "autoscaling.perf_model", "autoscaling.histogram", "autoscaling.profiling", "autoscaling.standby",
     "autoscaling.prefill_scaling", "autoscaling.router_pressure",
     "routes.api", "routes.classifier", "routes.cache_keys", "routes.answers", "routes.memory_store", "routes.monitor",
     "routes.figures", "routes.table", "routes.status", "routes.learned", "routes.replicas", "routes.anchors",
     "routes.prompt_words", "routes.answer_facts"),
    ("config",),  # plain values
)
OPERATOR_TIER = {f"kaon_operator.{m}": depth for depth, modules in enumerate(OPERATOR_TIERS) for m in modules}
PURE = len(OPERATOR_TIERS) - 2  # the pure decisions' tier: the router imports it and the tier below, nothing above
# Third-party packages the operator image does not have.
# (tokenizers and jinja2 are in the operator image too: the router's kv-aware strategy tokenizes prompts.)
ENGINE_ONLY = ("torch", "triton", "numpy", "gguf", "safetensors", "transformers", "fastapi", "uvicorn",
               "xgrammar")


def module_files(roots=SOURCE_ROOTS) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the source roots (a package is its __init__)."""
    out = {}
    for root in roots:
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Every dotted name `module` imports, relative imports resolved; `from a import b` gives `a.b`
    (which resolves to module a.b if there is one, else to a)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield from (f"{base}.{alias.name}" for alias in node.names)


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module a dotted name lands in (its longest known prefix), or None for third-party code."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges = {}
    for module, path in modules.items():
        targets = {resolve(name, modules) for name in imported_names(module, path)}
        edges[module] = {t for t in targets if t and t != module}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> str:
    """kaon_runtime.engine.scheduler -> engine; kaon_runtime.cli -> cli; kaon_runtime -> kaon_runtime."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def wrong_arrows(edges: dict[str, set[str]]) -> list[str]:
    """Runtime imports that go up a tier, or sideways to another layer of the same tier."""
    wrong = []
    for source, targets in edges.items():
        if not source.startswith("kaon_runtime"):
            continue
        for target in targets:
            if not target.startswith("kaon_runtime") or layer(source) == layer(target):
                continue
            if TIER[layer(target)] <= TIER[layer(source)]:
                wrong.append(f"{source} -> {target}")
    return sorted(wrong)


def is_router(module: str) -> bool:
    return module == "kaon_operator.router" or module.startswith("kaon_operator.router.")


def operator_packages(modules: dict[str, Path]) -> set[str]:
    """The operator's packages (their __init__ holds no code), which need no tier."""
    return {m for m, path in modules.items() if m.startswith("kaon_operator") and path.name == "__init__.py"
            and not is_router(m)}


def wrong_operator_arrows(edges: dict[str, set[str]]) -> list[str]:
    """Operator imports that go up a tier; router imports of anything but the pure decisions; operator
    imports of the router."""
    wrong = []
    for source, targets in edges.items():
        if not source.startswith("kaon_operator"):
            continue
        for target in targets:
            if is_router(source):
                up = target in OPERATOR_TIER and OPERATOR_TIER[target] < PURE
            else:
                up = is_router(target) or OPERATOR_TIER.get(target, len(OPERATOR_TIERS)) < OPERATOR_TIER.get(source, 0)
            if up:
                wrong.append(f"{source} -> {target}")
    return sorted(wrong)


def crossings(modules: dict[str, Path]) -> list[str]:
    """Imports between kaon_runtime and kaon_operator, and engine-only libraries in the operator; kaon_wire,
    which both carry, imports neither."""
    wrong = []
    for module, path in modules.items():
        package = module.split(".")[0]
        for name in imported_names(module, path):
            top = name.split(".")[0]
            if package == "kaon_runtime" and top == "kaon_operator":
                wrong.append(f"{module} -> {name}")
            if package == "kaon_operator" and (top == "kaon_runtime" or top in ENGINE_ONLY):
                wrong.append(f"{module} -> {name}")
            if package == "kaon_wire" and (top in ("kaon_runtime", "kaon_operator") or top in ENGINE_ONLY):
                wrong.append(f"{module} -> {name}")  # both images carry it: it must need neither side
    return sorted(wrong)


MODULES = module_files()
EDGES = graph(MODULES)


def test_every_runtime_layer_has_a_tier():
    layers = {layer(m) for m in MODULES if m.startswith("kaon_runtime")}
    assert layers <= set(TIER), f"give these a tier in TIERS: {sorted(layers - set(TIER))}"


def test_no_import_circles():
    assert circles(EDGES) == []


def test_no_arrow_runs_up_the_runtimes_layers():
    assert wrong_arrows(EDGES) == []


def test_every_operator_module_has_a_tier():
    modules = {m for m in MODULES if m.startswith("kaon_operator") and not is_router(m)} - operator_packages(MODULES)
    missing, gone = sorted(modules - set(OPERATOR_TIER)), sorted(set(OPERATOR_TIER) - modules)
    assert not missing and not gone, f"give these a tier in OPERATOR_TIERS: {missing}; these are gone: {gone}"


def test_no_arrow_runs_up_the_operators_layers():
    assert wrong_operator_arrows(EDGES) == []


def test_the_runtime_and_the_operator_import_nothing_of_each_other():
    assert crossings(MODULES) == []


# The checks themselves, on small trees: each must see what it guards against.

def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return module_files((tmp_path,))


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    modules = _tree(tmp_path, {
        "kaon_runtime/__init__.py": "",
        "kaon_runtime/cli.py": "def serve():\n    from kaon_runtime.server.run import serve\n",
        "kaon_runtime/server/__init__.py": "",
        "kaon_runtime/server/run.py": "from kaon_runtime.cli import options\n",
    })
    assert circles(graph(modules)) == [["kaon_runtime.cli", "kaon_runtime.server.run"]]


def test_upward_and_sideways_arrows_are_found(tmp_path):
    modules = _tree(tmp_path, {
        "kaon_runtime/__init__.py": "",
        "kaon_runtime/distributed/__init__.py": "",
        "kaon_runtime/distributed/workers.py": "from ..engine import model_runner\n",
        "kaon_runtime/engine/__init__.py": "",
        "kaon_runtime/engine/model_runner.py": "from kaon_runtime.loader import open_checkpoint\n",
        "kaon_runtime/loader/__init__.py": "from kaon_runtime.quant import surgery\n",
        "kaon_runtime/quant/__init__.py": "",
        "kaon_runtime/quant/surgery.py": "import torch\n",
    })
    assert wrong_arrows(graph(modules)) == ["kaon_runtime.distributed.workers -> kaon_runtime.engine.model_runner",
                                            "kaon_runtime.loader -> kaon_runtime.quant.surgery"]


def test_imports_between_the_packages_are_found(tmp_path):
    modules = _tree(tmp_path, {
        "kaon_runtime/__init__.py": "",
        "kaon_runtime/cli.py": "def main():\n    import kaon_operator.main\n",
        "kaon_operator/__init__.py": "",
        "kaon_operator/scraper.py": "import torch\nfrom kaon_runtime.server import metrics\n",
    })
    assert crossings(modules) == ["kaon_operator.scraper -> kaon_runtime.server.metrics",
                                  "kaon_operator.scraper -> torch", "kaon_runtime.cli -> kaon_operator.main"]


def test_upward_arrows_in_the_operator_are_found(tmp_path):
    modules = _tree(tmp_path, {
        "kaon_operator/__init__.py": "",
        "kaon_operator/kube.py": "",
        "kaon_operator/config.py": "from kaon_operator.children import resources\n",
        "kaon_operator/children/__init__.py": "",
        "kaon_operator/children/changes.py": "from kaon_operator.kube import FIELD_MANAGER\n",
        "kaon_operator/children/resources.py": "from kaon_operator.config import NetworkPolicyConfig\n",
        "kaon_operator/reconciler.py": "from kaon_operator import kube\nfrom kaon_operator.router import main\n",
        "kaon_operator/router/__init__.py": "",
        "kaon_operator/router/main.py": "from kaon_operator.children import resources\nfrom . import watch\n",
        "kaon_operator/router/watch.py": "def run():\n    from kaon_operator import caches\n",
        "kaon_operator/caches.py": "",
    })
    assert wrong_operator_arrows(graph(modules)) == [
        "kaon_operator.children.changes -> kaon_operator.kube",
        "kaon_operator.config -> kaon_operator.children.resources",
        "kaon_operator.reconciler -> kaon_operator.router.main", "kaon_operator.router.watch -> kaon_operator.caches"]
