"""The import graph of the tutel package, read from its source with ``ast``, and the layer rule
docs/design.md states for it ("Layers of the code": a table of layers, top to bottom).

A module may import another only when that module's layer lies strictly below its own, or when
both belong to the same unit (a subpackage of tutel, or a top-level module, with its own files).
Imports inside functions count: a lazy import is still a dependency.  Separately, the graph of
modules must hold no cycle at all, and only tutel.ops may reach the compiled extension: no other
module names tutel._C, its loader or ``torch.ops.tutel`` (extension_reaches).
"""
import ast
import pathlib
import re
from typing import Dict, Iterable, List, Optional, Set, Tuple

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPOSITORY / "tutel"
DESIGN = REPOSITORY / "docs" / "design.md"

_TABLE_START = "<!-- layers: top to bottom -->"
_TABLE_END = "<!-- /layers -->"
_UNIT = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """tutel/ops/backend.py -> 'tutel.ops.backend'; a package's __init__.py -> the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_sources(root: pathlib.Path = PACKAGE) -> Dict[str, Tuple[str, bool]]:
    """{module: (source, is_package)} for every .py file under `root`."""
    return {module_name(path, root): (path.read_text(encoding="utf-8"), path.name == "__init__.py")
            for path in sorted(root.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(sources: Dict[str, Tuple[str, bool]], package: str = "tutel") -> Dict[str, Set[str]]:
    """{module: modules of `package` it imports} (``from X import name`` names module X.name when
    that is a module, else X; compiled modules such as tutel._C count as modules)."""
    graph: Dict[str, Set[str]] = {}
    for module, (source, is_package) in sources.items():
        targets = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources or alias.name == "_C"
                         else base for alias in node.names]
            else:
                continue
            targets.update(name for name in names if name == package or name.startswith(package + "."))
        targets.discard(module)
        graph[module] = targets
    return graph


def read_layers(text: Optional[str] = None) -> List[Set[str]]:
    """The units of each layer, top to bottom, from the table between the layer markers of
    docs/design.md (the units are the table's `code` spans of its second column)."""
    text = DESIGN.read_text(encoding="utf-8") if text is None else text
    start, end = text.index(_TABLE_START), text.index(_TABLE_END)
    layers = []
    for line in text[start:end].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and _UNIT.search(cells[1]):
            layers.append(set(_UNIT.findall(cells[1])))
    return layers


def unit_of(module: str) -> str:
    """The layer unit of a module: its first component below the package ('' for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(graph: Dict[str, Set[str]], layers: List[Set[str]]) -> List[str]:
    """Every import that does not point to a strictly lower layer (or stays inside its unit), every
    import of the package itself, and every unit the table does not place."""
    depth = {unit: index for index, units in enumerate(layers) for unit in units}
    problems = []
    for module, targets in sorted(graph.items()):
        source_unit = unit_of(module)
        if source_unit and source_unit not in depth:
            problems.append(f"{module}: its unit `{source_unit}` is in no layer of docs/design.md")
            continue
        for target in sorted(targets):
            target_unit = unit_of(target)
            if not target_unit:
                if source_unit:
                    problems.append(f"{module} imports the package `{target}` itself (import the module it needs)")
                continue
            if not source_unit or target_unit == source_unit:
                continue
            if target_unit not in depth:
                problems.append(f"{module} imports {target}, whose unit `{target_unit}` is in no layer")
            elif depth[target_unit] <= depth[source_unit]:
                relation = "the same layer as" if depth[target_unit] == depth[source_unit] else "a layer above"
                problems.append(f"{module} imports {target}: `{target_unit}` is in {relation} `{source_unit}`")
    return problems


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def units(modules: Iterable[str]) -> Set[str]:
    return {unit_of(module) for module in modules if unit_of(module)}


# The one package that may reach the compiled extension, and the modules outside it that still do
# (none: every other module takes the operators from tutel.ops).
EXTENSION_DOOR = "tutel.ops"
REACHING_ALLOWED: Tuple[str, ...] = ()
_EXTENSION = "tutel._C"
_LOADER = "load_extension"


def _is_torch_ops_tutel(node: ast.AST) -> bool:
    """True for the attribute chain ``torch.ops.tutel``."""
    return (isinstance(node, ast.Attribute) and node.attr == "tutel" and isinstance(node.value, ast.Attribute)
            and node.value.attr == "ops" and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch")


def _reaches(module: str, is_package: bool, node: ast.AST) -> Optional[str]:
    """What `node` names of the extension (its module, its loader, its operators), or None."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == _EXTENSION or alias.name.startswith(_EXTENSION + "."):
                return f"imports {alias.name}"
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(module, is_package, node)
        if base == _EXTENSION or base.startswith(_EXTENSION + "."):
            return f"imports from {base}"
        for alias in node.names:
            if alias.name == "_C" and base == "tutel":
                return f"imports {_EXTENSION}"
            if alias.name == _LOADER:
                return f"imports {_LOADER} from {base}"
            if alias.name == "tutel" and base == "torch.ops":
                return "imports torch.ops.tutel"
    elif _is_torch_ops_tutel(node):
        return "names torch.ops.tutel"
    elif isinstance(node, ast.Attribute):
        if node.attr == _LOADER:
            return f"names {_LOADER}"
        if node.attr == "_C" and isinstance(node.value, ast.Name) and node.value.id == "tutel":
            return f"names {_EXTENSION}"
    elif isinstance(node, ast.Name) and node.id == _LOADER:
        return f"names {_LOADER}"
    elif isinstance(node, ast.Call):
        for argument in node.args:
            if isinstance(argument, ast.Constant) and argument.value == _EXTENSION:
                return f"imports {_EXTENSION} by name"
            # torch.library.custom_op("tutel::x"), register_fake("tutel::x"), ...: an operator of
            # torch.ops.tutel defined or reached by its name
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str) and \
                    argument.value.startswith("tutel::"):
                return f"names the operator {argument.value}"
    return None


def extension_reaches(sources: Dict[str, Tuple[str, bool]], door: str = EXTENSION_DOOR,
                      allowed: Iterable[str] = REACHING_ALLOWED) -> List[str]:
    """'module:line: what it names' for every place outside `door` (and the `allowed` modules) that
    reaches the compiled extension: an import of tutel._C (``from . import _C``, ``import tutel._C``),
    the attribute ``tutel._C``, the loader ``load_extension``, the chain ``torch.ops.tutel`` or an
    operator's qualified name ``"tutel::..."`` passed to a call."""
    allowed = set(allowed)
    problems = []
    for module, (source, is_package) in sorted(sources.items()):
        if module == door or module.startswith(door + ".") or module in allowed:
            continue
        # A set: one finding per line and kind, however many nodes of the line show it.
        found = {(node.lineno, what) for node in ast.walk(ast.parse(source))
                 for what in [_reaches(module, is_package, node)] if what is not None}
        problems += [f"{module}:{line}: {what} (only {door} may reach the compiled extension; take it from there)"
                     for line, what in sorted(found)]
    return problems
