"""Reading YAML the user handed us: safe, bounded, and strict about mappings.

PyYAML's SafeLoader builds no objects, but it expands aliases without limit (a "billion
laughs" file of a few hundred bytes grows to gigabytes) and lets a repeated mapping key
silently replace the first. Before building anything, this loader counts the values the
composed document expands to, every alias use included, and refuses one past MAX_NODES; it
refuses a repeated key. Either is one line naming the file.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from difftest.base.errors import ConfigError

# A case file has at most a few thousand nodes (long prompt id lists); an alias bomb needs millions.
MAX_NODES = 200_000


class _TooBig(yaml.YAMLError):
    pass


class _Duplicate(yaml.YAMLError):
    def __init__(self, key: object, line: int):
        super().__init__(f"key {key!r} appears twice in one mapping")
        self.key, self.line = key, line


class StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hashable = key in seen
                except TypeError:
                    continue  # SafeLoader refuses an unhashable key itself
                if hashable:
                    raise _Duplicate(key, key_node.start_mark.line + 1)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _count_expansion(node, memo: dict) -> int:  # recursion depth: the document's nesting depth
    """Nodes the document expands to, aliases counted at every use (memoised per node)."""
    key = id(node)
    if key in memo:
        if memo[key] is None:
            raise _TooBig("an alias refers to a value that contains it (a recursive structure)")
        return memo[key]
    memo[key] = None  # in progress
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_count_expansion(n, memo) for n in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_count_expansion(k, memo) + _count_expansion(v, memo) for k, v in node.value)
    memo[key] = total
    return total


def load_yaml(path: Path, text: str) -> object:
    """The parsed document; ConfigError (one line naming `path`) for malformed YAML, a repeated key,
    or a document that expands past MAX_NODES."""
    try:
        loader = StrictLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            size = _count_expansion(node, {})
            if size > MAX_NODES:
                raise _TooBig(f"expands to {size} values, more than {MAX_NODES} (an alias expansion bomb?)")
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except _TooBig as e:
        raise ConfigError(f"{path}: refused: {e}") from None
    except _Duplicate as e:
        raise ConfigError(f"{path}: line {e.line}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: refused: nested too deeply") from None
