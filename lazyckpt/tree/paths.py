"""Key paths of a state: the readable text messages name a value by, and the tensor names of the format.

A path is the tuple of keys and indices from the state's root to a value; :func:`path_str` is how every message
names it, :func:`tensor_key` the tensor's name in the safetensors file.

Example:
    >>> path_str(("optimizer", "state", 0))
    "state['optimizer']['state'][0]"
    >>> tensor_key(("model", "layer.weight"))
    'model/layer.weight'
"""

from __future__ import annotations

import functools
from urllib.parse import quote

Path = tuple["str | int | tuple", ...]


def path_str(path: Path) -> str:
    """A readable key path for messages, e.g. ``state['optimizer']['state'][0]``."""
    return "state" + "".join(f"[{p!r}]" for p in path)


def tensor_key(path: Path) -> str:
    """The tensor's name in the safetensors file: escaped components joined by ``/``; never collides.

    Cached for paths of exact ``str`` and ``int`` parts only: a training loop saves the same paths every time, and
    quoting was a quarter of ``save()``'s time. Other parts compare equal across types (``1 == 1.0 == True`` in a
    tuple key, an ``IntEnum`` member and its value) while naming different keys, so a cache would answer with the
    key of whichever path came first.
    """
    for part in path:
        if type(part) is not str and type(part) is not int:
            return _joined(path)
    return _cached(path)


@functools.lru_cache(maxsize=1 << 16)
def _cached(path: Path) -> str:
    return _joined(path)


def _joined(path: Path) -> str:
    if not path:
        return "%24"
    return "/".join([_str_part(p) if type(p) is str else _key_part(p) for p in path])


def _key_part(part: str | int | tuple) -> str:
    # quote() escapes "[" and "(", so int ("[3]") and tuple ("(...)") parts never look like a str part.
    if isinstance(part, int):
        return f"[{int.__repr__(part)}]"  # digits (rule 9), also for an int subclass: str(Enum member) is its name
    if isinstance(part, tuple):
        return f"({quote(repr(part), safe='')})"
    return quote(part, safe="")


@functools.lru_cache(maxsize=1 << 16)
def _str_part(part: str) -> str:
    return quote(part, safe="")


def legacy_int_parts(stored: str, path: Path) -> list[tuple[int, str]] | None:
    """Where ``stored`` differs from ``tensor_key(path)`` only in int parts written as ``[text]`` with a text that
    is no decimal int (writers before this rule was enforced wrote ``f"[{key}]"``, e.g. ``[Level.LOW]`` for the key
    ``Level.LOW`` of ``class Level(int, Enum)``): the position and stored text of each such part; else None (the
    key names another path: a different str or tuple part, or another int)."""
    texts = stored.split("/")
    if not path or len(texts) != len(path):
        return None
    legacy = []
    for i, (text, part) in enumerate(zip(texts, path)):
        if text == _key_part(part):
            continue
        inner = text[1:-1]
        if type(part) is not int or not (text.startswith("[") and text.endswith("]")) or not inner \
                or inner.lstrip("-").isdigit() or "[" in inner or "]" in inner:
            return None
        legacy.append((i, text))
    return legacy or None
