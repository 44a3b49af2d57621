"""DeepCompile's profilers generated each graph's Python code to name the file its profile is kept in (patch
deepcompile-profile-key-without-codegen).

A profile is kept beside Inductor's cache, keyed on its graph, so that a restarted job plans from it
(tests/test_deepcompile_profiles_kept_for_a_restart.py). The key held graph.python_code(), which generates the graph's
whole code: 0.1 s for a 16-layer Llama graph on the CPU, and the profilers key each graph they run, six times at the
WARMUP step and six again at a restart. The key now holds each node's name, op, target and arguments, written out
without generating code (a tenth of the time), and without the addresses of objects.

On the CPU, in one process: keys of graphs alike but for an argument's value, and of the same graph built twice with a
function of its own as an argument (another object at another address each time), python_code counted.
"""

import pytest

import cpu_worker
from test_deepcompile_profiler_times_each_gather_shape_once import PROFILERS_ON_CPU

KEYS = """
    import tempfile
    import torch.fx

    inductor_config.fx_graph_cache = True
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
    codegen = []
    python_code = torch.fx.Graph.python_code

    def counted(self, *args, **kwargs):
        codegen.append(1)
        return python_code(self, *args, **kwargs)

    torch.fx.Graph.python_code = counted

    def apply(fn, x):
        return fn(x)

    def scaled(c):
        def scale(x):  # a new function object at every call
            return x * c
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        y = graph.call_function(torch.mul, (x, c))
        graph.output((graph.call_function(apply, (scale, y)), ))
        return graph

    x = torch.randn(4, 4)
    device = torch.device("cpu")
    key = lambda graph: graph_profile._kept_profile_file("memory", graph, [x], device)
    first, again, other = key(scaled(2.0)), key(scaled(2.0)), key(scaled(3.0))
    text = graph_profile._graph_text(scaled(2.0)) if hasattr(graph_profile, "_graph_text") else ""  # before the patch
    print("KEYS " + json.dumps(dict(first=first, again=again, other=other, codegen=len(codegen), text=text)))
"""


@pytest.fixture(scope="module")
def keys():
    return cpu_worker.code_report(PROFILERS_ON_CPU + KEYS, "KEYS ")


def test_a_profiles_key_generates_no_code(keys):
    assert keys["first"], keys  # a key, with Inductor's cache on
    assert keys["codegen"] == 0, keys


def test_the_same_graph_built_again_has_the_same_key(keys):
    assert " at 0x" not in keys["text"], keys["text"]
    assert keys["again"] == keys["first"], keys


def test_a_graph_differing_in_an_arguments_value_has_another_key(keys):
    assert keys["other"] != keys["first"], keys
