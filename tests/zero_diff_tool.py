"""tools/zero-diff, loaded as a module for the CPU suite's differential tests: the environment a worker of a site
runs in (site_env) and where two records of one cell first differ (first_difference)."""

import importlib.machinery
import importlib.util
import os

_loader = importlib.machinery.SourceFileLoader(
    "zero_diff_tool_module", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                                          "zero-diff"))
_spec = importlib.util.spec_from_loader(_loader.name, _loader)
_tool = importlib.util.module_from_spec(_spec)
_loader.exec_module(_tool)

site_env = _tool.site_env
first_difference = _tool.first_difference
