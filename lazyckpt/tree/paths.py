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


@functools.lru_cache(maxsize=1 << 16)
def tensor_key(path: Path) -> str:
    """The tensor's name in the safetensors file: escaped components joined by ``/``; never collides.

    Cached: a training loop saves the same paths every time, and quoting was a quarter of ``save()``'s time.
    """
    if not path:
        return "%24"
    return "/".join(_key_part(p) for p in path)


def _key_part(part: str | int | tuple) -> str:
    # quote() escapes "[" and "(", so int ("[3]") and tuple ("(...)") parts never look like a str part.
    if isinstance(part, int):
        return f"[{part}]"
    if isinstance(part, tuple):
        return f"({quote(repr(part), safe='')})"
    return quote(part, safe="")
