"""A manifest's YAML, read with limits: a manifest is a small tree of settings, and a file that is not
one is refused at once with its reason, never expanded, recursed into or walked at length.

Refused: more than MAX_BYTES of text; aliases (`*name`: the billion-laughs bomb is a few of them);
a key given twice in one mapping (YAML's last-wins would hide the first); nesting deeper than MAX_DEPTH
(named by its path); more than MAX_NODES nodes.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_BYTES = 1 << 20
MAX_DEPTH = 16
MAX_NODES = 20_000


class ManifestYAMLError(ValueError):
    pass


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML has it


def load_yaml(text: str) -> tuple[yaml.Node | None, Any]:
    """-> (the composed node tree, for line numbers; the data). Raises ManifestYAMLError (a limit) or
    yaml.YAMLError (not YAML)."""
    if len(text) > MAX_BYTES:
        raise ManifestYAMLError(f"{len(text)} characters; a manifest may have at most {MAX_BYTES}")
    loader = _Loader(text)
    try:
        try:
            root = loader.get_single_node()
        except RecursionError:
            raise ManifestYAMLError(f"nested more than {MAX_DEPTH} levels deep") from None
        if root is None:
            return None, None
        _check_tree(root)
        return root, loader.construct_document(root)
    finally:
        loader.dispose()


def _check_tree(root: yaml.Node) -> None:
    """Walk the node tree once, before anything is built from it. An alias is a node met a second
    time (the composer shares the anchored node), so it is caught before it can be expanded."""
    stack: list[tuple[yaml.Node, str, int]] = [(root, "", 0)]
    nodes, seen_nodes = 0, set()
    while stack:
        node, path, depth = stack.pop()
        if id(node) in seen_nodes:
            raise ManifestYAMLError(
                f"{path} (line {node.start_mark.line + 1}): YAML aliases (*name) are not allowed in a "
                "manifest; write the value out"
            )
        seen_nodes.add(id(node))
        nodes += 1
        if nodes > MAX_NODES:
            raise ManifestYAMLError(f"more than {MAX_NODES} YAML nodes; a manifest is a few dozen settings")
        if depth > MAX_DEPTH:
            raise ManifestYAMLError(f"{path}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, value in node.value:
                name = str(key.value)
                if name in seen:
                    raise ManifestYAMLError(
                        f"{path + '.' if path else ''}{name} (line {key.start_mark.line + 1}): given twice "
                        f"(first on line {seen[name]})"
                    )
                seen[name] = key.start_mark.line + 1
                stack.append((value, f"{path}.{name}" if path else name, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node.value))


__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "ManifestYAMLError", "load_yaml"]
