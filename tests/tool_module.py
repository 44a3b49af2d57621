"""A tool of tools/ (a script without a .py suffix) loaded as a module, for the tests that call its functions."""

import importlib.machinery
import importlib.util
import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def load(name):
    """tools/NAME as a new module, each call its own (tests may change its globals); tools/ goes on sys.path first, for
    the modules the tool imports from beside it."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_") + "_tool", os.path.join(TOOLS, name))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module
