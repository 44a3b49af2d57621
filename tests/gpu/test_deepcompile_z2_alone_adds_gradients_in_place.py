"""DeepCompile ZeRO-2 at one rank adds each gradient to its buffer, with no bucket, division or all-reduce (patch
deepcompile-z2-alone-adds-gradients-in-place).

DeepCompile's ZeRO-2 op reduces the gradients of every micro-batch through a reduce bucket: a copy of each gradient
into it on a side stream, a division by the world size, an all-reduce, and an add from the bucket into the gradient
buffer. At world size 1 all of it but the add is wasted, three passes over every gradient where one does: the defect
ZeRO-1's op had (test_deepcompile_z1_alone_adds_gradients_in_place.py, whose checks this test shares).

workers/dc_reduce_ops.py trains stacks of 4 and 16 linear layers with eager and DeepCompile ZeRO-2 at one rank, fp32,
and profiles one more DeepCompile step: one add_ a reduce_grad, no copy, division or multi-tensor add from a bucket,
and the losses and gradient norms of eager ZeRO-2.
"""

from test_deepcompile_z1_alone_adds_gradients_in_place import assert_each_gradient_added_in_place


def test_one_rank_adds_each_gradient_to_its_buffer_without_a_bucket():
    assert_each_gradient_added_in_place(stage=2)
