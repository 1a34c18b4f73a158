"""Put first on PYTHONPATH by ``bench/gpu_suite.py --dry``: with MT_RECORD_IMPORTS naming a folder, each Python
process there behaves as on the GPU image, where a module that neither the image nor ``bench/gpu_wheels.sh``
brings does not import (the top-level names listed in the folder's ``blocked.json`` are None in ``sys.modules``:
``import`` raises ModuleNotFoundError, ``importlib.util.find_spec`` answers None), and writes, as it exits, the
third-party top-level modules it imported and the compile-cache variables it saw."""

import atexit
import json
import os
import sys

_FOLDER = os.environ.get("MT_RECORD_IMPORTS")
_CACHE_VARS = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
    "CUTE_DSL_CACHE_DIR",
)


_AT_START = {name.partition(".")[0] for name in sys.modules}  # (this interpreter's site set-up: .pth files)


def _third_party() -> list[str]:
    names = set()
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top in _AT_START:
            continue
        path = getattr(module, "__file__", None) or ""
        if top in sys.stdlib_module_names or top in sys.builtin_module_names or "-packages" not in path:
            continue  # (the checkout's own packages and bench scripts live outside site-packages)
        names.add(top)
    return sorted(names)


def _write() -> None:
    record = {
        "argv": " ".join(sys.argv[:3])[:200] + f" [{os.getpid()}]",
        "modules": _third_party(),
        "env": {name: os.environ.get(name) for name in _CACHE_VARS},
    }
    with open(os.path.join(_FOLDER, f"{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


if _FOLDER:
    _blocked = os.path.join(_FOLDER, "blocked.json")
    if os.path.isfile(_blocked):
        with open(_blocked) as f:
            for _name in json.load(f):
                sys.modules.setdefault(_name, None)  # (one imported already stays: it is the interpreter's)
    atexit.register(_write)
