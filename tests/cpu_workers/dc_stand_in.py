"""DeepCompile on the CPU for the workers of this folder: its native op needs CUDA, so the handle to it and the ZeRO
backends are stood in for, and everything else (deepspeed.initialize, engine.compile(), the pass schedule) is real.
"""

import sys


class NoOpHandle:
    """A native handle whose every method does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def stand_in_deepcompile(handle, compile_graph):
    """Every deepspeed module imported so far gets `handle` for DeepCompile's native handle, and the ZeRO-1/2 and
    ZeRO-3 backends hand each Dynamo graph to `compile_graph(gm, example_inputs)`, which returns what runs it."""
    import deepspeed.compile.init_z1_and_2 as init_z12
    import deepspeed.compile.init_z3 as init_z3

    for name, module in list(sys.modules.items()):
        if name.startswith("deepspeed") and hasattr(module, "get_deepcompile_handle"):
            module.get_deepcompile_handle = lambda: handle
    init_z12.make_backend = init_z3.make_backend = lambda *args, **kwargs: compile_graph
