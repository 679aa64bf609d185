"""dsv4-serve's one import namespace: `dsv4_serve.service`, `dsv4_serve.model`, `dsv4_serve.kernels`.

The repository keeps those three folders at its root; an install maps them under this package
(pyproject's `package-dir`), so nothing generic (`kernels`, `model`, `service`) reaches site-packages,
where PyPI's `kernels` (brought by transformers) would shadow ours or ours it. In a checkout run without
an install (bench/, tools/, the GPU machine's PYTHONPATH) the package's path also holds the checkout's
root, so `dsv4_serve.kernels` is `./kernels` there too.
"""

from __future__ import annotations

import os

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A checkout: the three folders sit beside this one.
if all(os.path.isfile(os.path.join(_root, *p)) for p in (("pyproject.toml",), ("kernels", "__init__.py"))):
    __path__.append(_root)  # type: ignore[name-defined]
