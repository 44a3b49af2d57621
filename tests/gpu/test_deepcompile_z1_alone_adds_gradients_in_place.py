"""DeepCompile ZeRO-1 at one rank adds each gradient to its buffer, with no bucket, division or all-reduce (patch
deepcompile-z1-alone-adds-gradients-in-place).

At world size 1 there is nothing to reduce, yet DeepCompile's ZeRO-1 op copied every gradient into a reduce bucket
(a copy and its events on a side stream), divided the bucket by one, all-reduced it alone and added it from the bucket
into the gradient buffers: three passes over every gradient where one add does. At the 0.55B Llama on one H200 that
was 1.8 ms of device time a step (223 copies of 0.88 ms, the division 0.51 ms, the add from the bucket 0.94 ms;
docs/bench.md), in a step where DeepCompile ZeRO-1 is 1.11-1.20x torch.compile at DeepSpeed's precision.

workers/dc_reduce_ops.py (shared with test_deepcompile_z1_bucket_reduction.py) trains stacks of 4 and 16 linear layers
with eager ZeRO-1 and DeepCompile ZeRO-1 at one rank, fp32, and profiles one more DeepCompile step: the aten ops
DeepCompile's ops call. Each gradient is added to its buffer once (one add_ a reduce_grad); nothing is copied,
divided or added from a bucket; the losses and gradient norms stay eager ZeRO-1's.
"""

import math

from test_deepcompile_z1_bucket_reduction import LAYERS, RTOL, run

# What a flush of a bucket calls, and the copy of each gradient into it: none of it at one rank.
BUCKET_OPS = ("aten::copy_", "aten::div_", "aten::_foreach_add_")


def assert_each_gradient_added_in_place(stage):
    """At one rank, DeepCompile ZeRO-`stage` adds each gradient to its buffer once and fills no bucket; its losses and
    gradient norms stay eager ZeRO-`stage`'s."""
    runs = run(1, stage)
    for n in LAYERS:
        dc, eager = runs[n][0]["deepcompile"], runs[n][0]["eager"]
        ops = dc["ops_of_one_step"]
        print(f"\nZeRO-{stage}, {dc['params']} parameter tensors, ops called by DeepCompile's reduction in one step: "
              f"{ops}")
        assert dc["deepcompile_active"]
        assert ops["dc::reduce_grad"] == dc["params"], ops  # one gradient a parameter, one micro-batch
        assert ops.get("aten::add_", 0) == ops["dc::reduce_grad"], ops
        assert not {op: ops[op] for op in BUCKET_OPS if ops.get(op)}, ops
        assert len(dc["grad_norms"]) == len(eager["grad_norms"]) > 0
        for got, want in zip(dc["grad_norms"] + dc["losses"], eager["grad_norms"] + eager["losses"]):
            assert math.isfinite(got) and abs(got - want) <= RTOL * abs(want), (n, dc, eager)


def test_one_rank_adds_each_gradient_to_its_buffer_without_a_bucket():
    assert_each_gradient_added_in_place(stage=1)
