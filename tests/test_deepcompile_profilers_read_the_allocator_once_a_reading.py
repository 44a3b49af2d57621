"""DeepCompile's profilers read the CUDA allocator's statistics six to eight times for a node where two readings are
taken, one before it and one after (patch deepcompile-profilers-read-allocated-and-peak-together).

The operator profiler read the bytes allocated and their peak apart, and again for each of the figures it derives
from them (the node's allocation, its peak, both also as absolute readings); the memory profiler read four times a
node. Each read builds the allocator's whole statistics: at 16 layers of the Llama-3-8B width on 2 H200s the WARMUP
step read them 31,830 times. Both are now read together, once before a node and once after.

On the CPU, in one process: DeepSpeed's CUDA accelerator, whose statistics come from a scripted allocator (counted),
in front of both profilers, over nodes that each leave a known allocation and peak behind. Each node's readings must be
what that allocator says.
"""

import pytest

import cpu_worker
from test_deepcompile_profiler_times_each_gather_shape_once import PROFILERS_ON_CPU

PROFILE = """
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    # A scripted allocator: node i leaves BASE + 1000 i bytes allocated after a transient 100 i bytes above that.
    BASE, state, reads = 1 << 20, {"current": 1 << 20, "peak": 1 << 20}, []

    def stats(device=None):
        reads.append(1)
        return {"allocated_bytes": {"all": dict(state)}, "reserved_bytes": {"all": dict(state)}}

    def reset_peak(device=None):
        state["peak"] = state["current"]

    torch.cuda.memory_stats_as_nested_dict = stats
    torch.cuda.reset_peak_memory_stats = reset_peak
    cuda = CUDA_Accelerator()
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda device_index=None: None
    profile_on_cpu(cuda)
    graph_profile.get_accelerator = lambda: cuda

    def touch(x, i):
        state["current"] = BASE + 1000 * i
        state["peak"] = max(state["peak"], state["current"] + 100 * i)
        return x + i

    NODES = 6
    graph = torch.fx.Graph()
    h = graph.placeholder("x")
    for i in range(1, NODES + 1):
        h = graph.call_function(touch, (h, i))
    graph.output((h, ))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    touches = [n for n in gm.graph.nodes if n.target is touch]

    report = {}
    for name, make in (("time", graph_profile.ProfilingInterpreter),
                       ("memory", graph_profile.MemoryProfilingInterpreter)):
        state.update(current=BASE, peak=BASE)
        reads.clear()
        x = torch.zeros(2)
        with FakeTensorMode():  # as in a compile (tests/cpu_workers/dc_profile_graph_mismatch.run_profiler)
            make(gm).run(x)
        report[name] = dict(reads=len(reads), nodes=len(gm.graph.nodes),
                            readings=[[n.meta.get(k) for k in ("alloc_mem", "max_mem", "profile_mem_start",
                                                               "profile_mem_peak")] for n in touches])
    print("READS " + json.dumps(report))
"""

BASE = 1 << 20


@pytest.fixture(scope="module")
def report():
    return cpu_worker.code_report(PROFILERS_ON_CPU + PROFILE, "READS ")


@pytest.mark.parametrize("profiler", ["time", "memory"])
def test_each_node_reads_the_allocator_twice(report, profiler):
    # One read before the node and one after; the memory profiler reads once more when it starts and when it is made.
    assert report[profiler]["reads"] <= 2 * report[profiler]["nodes"] + 2, report[profiler]


def test_the_operator_profiler_reads_each_nodes_allocation_and_peak(report):
    expected = [[1000, 1000 + 100 * i, BASE + 1000 * (i - 1), BASE + 1100 * i] for i in range(1, 7)]
    assert report["time"]["readings"] == expected, report["time"]["readings"]


def test_the_memory_profiler_reads_each_nodes_start_and_peak(report):
    starts_and_peaks = [r[2:] for r in report["memory"]["readings"]]
    assert starts_and_peaks == [[BASE + 1000 * (i - 1), BASE + 1100 * i] for i in range(1, 7)], starts_and_peaks
