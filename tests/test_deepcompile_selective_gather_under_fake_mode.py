"""AOTAutograd compiles a backward graph that saves symbolic sizes (new sequence lengths) before the graph first runs,
with its fake mode active, and DeepCompile's passes run inside that compile. 0.19.8's selective_gather, the last
pass of the last backward graph, reduces the ranks' total and free memory in a tensor it makes there: a fake tensor,
whose .item() raises. AOTAutograd logs "failed to eagerly compile backwards", drops the compile and does it again,
with a second profiling of the backward, at the graph's first run; the error's traceback keeps the first
profiling's backward inputs alive until the garbage collector runs (the model zoo's Llama at ZeRO-3 on 2 GPUs: the
memory allocated before each optimizer step moved by 1 MiB with the collector's timing).

Here selective_gather runs as in that compile, inside a FakeTensorMode, at one rank on gloo, for a graph with a
complete profile and no parameter to keep, on the CPU."""

from test_deepcompile_graph_ids_survive_a_restart import free_port
from test_deepcompile_prefetch_survives_dead_code_elimination import ONE_GLOO_RANK, run


def test_selective_gather_reduces_real_memory_figures_inside_a_fake_mode():
    run(ONE_GLOO_RANK.format(port=free_port()) + """
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.compile.passes import selective_gather
    from deepspeed.compile.profilers import ProfilingResult
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    reduced = []
    all_reduce = dist.all_reduce

    def recording(t, *args, **kwargs):
        reduced.append((is_fake(t), t.device.type))
        return all_reduce(t, *args, **kwargs)

    dist.all_reduce = recording
    # The CPU accelerator names its device by LOCAL_RANK, a string torch.device reads as a device type.
    get_accelerator().current_device = lambda: "cpu"
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with FakeTensorMode():
        out = selective_gather.selective_gather(gm, 1, [(1, True)], {1: ProfilingResult(fwd_graph=gm.graph)},
                                                None, 0.0, {}, True)
    assert out is gm
    assert reduced == [(False, "cpu")], f"memory figures reduced in (fake, device): {reduced}"
    """)
