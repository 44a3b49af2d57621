"""tools/zero-diff, loaded as a module for the CPU suite's differential tests: the environment a worker of a site
runs in (site_env) and where two records of one cell first differ (first_difference)."""

import tool_module

_tool = tool_module.load("zero-diff")

site_env = _tool.site_env
first_difference = _tool.first_difference
