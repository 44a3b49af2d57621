"""DeepCompile's graph ids must be the same when the same job starts again.

A graph's id goes into the graph DeepCompile hands to Inductor, as an argument of its ops (allgather_param,
release_param, reduce_grad). 0.19.8 took it from id(gm.graph), a memory address, so each process compiled a graph
that no other process had, and Inductor's FX graph cache, keyed on the graph, never served a job restarted with the
same model and config: it compiled everything again (at 32 layers of the 1.5B width, 44 s of Inductor in the warm-up,
docs/warmup.md).

Two processes here compile the same model through DeepCompile's backend (make_backend, world size 1 on gloo, the
compiled extension stood in for: only its reset is called), each with another amount of memory allocated first, and
report the ids their graphs got: equal in both, and distinct within each."""

import re
import subprocess
import textwrap

import pytest

from cpu_worker import cpu_env
from warm_python import python_command

from test_deepcompile_prefetch_survives_dead_code_elimination import DEFINE_OPS, ONE_RANK_BACKEND, free_port

PADDING = """
    import sys
    padding = [bytearray({padding}) for _ in range(100)]  # another heap in each process
"""
COMPILE = """
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)),
                             backend=backend.make_backend("eager", CompileConfig()), dynamic=False)
    for rows in (4, 6):  # two shapes, two graphs
        compiled(torch.randn(rows, 8)).sum().backward()
    print("GRAPH_IDS", list(backend.profiling_results))
"""


def graph_ids(padding):
    code = PADDING.format(padding=padding) + ONE_RANK_BACKEND.format(port=free_port()) + COMPILE
    script = textwrap.dedent(DEFINE_OPS) + textwrap.dedent(code)
    proc = subprocess.run([*python_command(), "-c", script], capture_output=True, text=True, timeout=600,
                          env=cpu_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"^GRAPH_IDS (\[.*\])$", proc.stdout, re.M)
    assert m, proc.stdout[-3000:]
    return eval(m.group(1))


def test_a_job_started_again_gives_its_graphs_the_same_ids():
    pytest.importorskip("deepspeed")
    first, again = graph_ids(10), graph_ids(1_000_000)
    assert len(first) == 2 and len(set(first)) == 2, first
    assert first == again, f"graph ids {first} in one process, {again} in the same job started again"
