"""Worker for tests/test_deepcompile_z3_ranks_compile_one_graph.py: two ranks compile a small model with Dynamo, each
given a batch of its own sequence length (--lengths differ) or of one length (--lengths same), or one rank an extra
tensor (--lengths extra) or so many more that its sizes are too many to compare (--lengths many), after
deepspeed.compile.util.mark_dims_that_differ_across_ranks_dynamic, which every call of the compiled model makes under
DeepCompile ZeRO-3 at several ranks (agree_on_input_sizes; until fork.24, DeepSpeedEngine.forward's calls only). On
CPU (gloo, DS_ACCELERATOR=cpu).

  torchrun --nproc-per-node 2 tests/cpu_workers/dc_inputs_differ_across_ranks.py --lengths differ

A backend records each graph Dynamo hands it: its placeholders' shapes and its operations. Each rank reports
(rank<RANK>.json) how many dimensions were marked, the graphs it compiled, and the value of a bucket both ranks
all-reduce at the end (a collective of the marking that one rank skipped would pair with it). --lengths
equal-then-differ runs three forwards, keeping the record of agreed sizes as the engine does (--unrecorded: without).
--lengths train-then-call-directly compiles the model with nn.Module.compile, as DeepSpeedEngine.compile does, trains
one step through what the engine's forward does, then calls the model itself under no_grad, as the Hugging Face
Trainer evaluates (rank 0: length 40 then 40, rank 1: 45 then 50).
"""

import argparse
import datetime
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import reduce_the_final_bucket, run_worker  # noqa: E402

LENGTHS = {"differ": (33, 34), "same": (33, 33), "extra": (33, 33), "many": (33, 33)}
# Three forwards a rank: the same length on both ranks first, then rank 1's changes, then rank 0's.
STEPS = {0: (33, 33, 36), 1: (33, 40, 33)}
MANY = 70  # --lengths many: rank 1 passes this many more tensors, more sizes than the ranks compare
# --lengths train-then-call-directly: (training length, evaluation length) of each rank.
DIRECT = {0: (40, 40), 1: (45, 50)}


SCENARIOS = sorted(LENGTHS) + ["equal-then-differ", "train-then-call-directly"]


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", choices=SCENARIOS)
    ap.add_argument("--unrecorded", action="store_true",
                    help="equal-then-differ without the record of sizes once agreed (the engine keeps one)")
    ap.add_argument("--scenarios", nargs="+", metavar="LENGTHS[+unrecorded]",
                    help="several --lengths one after another in this process, each reported under "
                    "report['scenarios'][NAME] with a final bucket of its own")
    args = ap.parse_args()
    import torch._dynamo
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    if args.scenarios is None:
        if args.lengths is None:
            ap.error("give --lengths or --scenarios")
        return scenario(report, args.lengths, args.unrecorded)
    report["scenarios"] = {}
    for name in args.scenarios:
        lengths, _, unrecorded = name.partition("+")
        if lengths not in SCENARIOS or unrecorded not in ("", "unrecorded"):
            raise ValueError(f"--scenarios {name}: want one of {SCENARIOS}, +unrecorded after equal-then-differ")
        # What a process of its own starts from: no graph, guard or automatic-dynamic record of the one before.
        torch._dynamo.reset()
        sub = report["scenarios"][name] = {"rank": report["rank"]}
        scenario(sub, lengths, bool(unrecorded))
        report.write()


def scenario(report, lengths, unrecorded):
    """One --lengths run: records into `report` what the test of it reads, and ends with the final bucket."""
    import torch
    from deepspeed.compile.util import mark_dims_that_differ_across_ranks_dynamic
    rank = report["rank"]
    graphs = report["graphs"] = []

    def shape(value):
        """A tensor's sizes, or a symbolic size Dynamo passes in as an input of its own; symbols shown as `s` (their
        numbers are the process's own)."""
        text = str(tuple(value.shape)) if isinstance(value, torch.Tensor) else f"size {value}"
        return re.sub(r"\bs\d+\b", "s", text)

    def record(gm, example_inputs):
        graphs.append({
            "inputs": [shape(n.meta["example_value"]) for n in gm.graph.nodes if n.op == "placeholder"],
            "ops": [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"],
        })
        return gm.forward

    class Net(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

        def forward(self, input_ids, attention_mask, extra=None):
            h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
            return self.out(h).logsumexp(-1).sum()

    torch.manual_seed(0)
    if lengths == "train-then-call-directly":
        from deepspeed.compile import util
        model, agreed = Net(), set()
        model.compile(backend=record)
        if hasattr(util, "agree_on_input_sizes"):
            util.agree_on_input_sizes(model, agreed=agreed)  # what DeepSpeedEngine.compile does since fork.25
            engine_forward = model
        else:

            def engine_forward(**kwargs):  # fork.18 to fork.24: DeepSpeedEngine.forward marked only its own calls
                util.mark_dims_that_differ_across_ranks_dynamic(((), kwargs), agreed=agreed)
                return model(**kwargs)

        def batch(length):
            ids = torch.randint(0, 16, (2, length))
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        train_length, eval_length = DIRECT[rank]
        engine_forward(**batch(train_length)).backward()
        with torch.no_grad():
            model(**batch(eval_length))  # the Trainer's evaluation calls the model itself
        return reduce_the_final_bucket(report)
    net = torch.compile(Net(), backend=record)
    if lengths == "equal-then-differ":
        agreed = None if unrecorded else set()
        report["marked"] = []
        for length in STEPS[rank]:
            ids = torch.randint(0, 16, (2, length))
            kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            report["marked"].append(mark_dims_that_differ_across_ranks_dynamic(((), kwargs), agreed=agreed))
            net(**kwargs)
            report.setdefault("graphs_after", []).append(len(graphs))
        return reduce_the_final_bucket(report)
    length = LENGTHS[lengths][rank]
    ids = torch.randint(0, 16, (2, length))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if lengths == "extra" and rank == 1:
        kwargs["extra"] = torch.zeros(3)
    if lengths == "many" and rank == 1:
        kwargs["extra"] = [torch.zeros(3) for _ in range(MANY)]
    report["marked"] = mark_dims_that_differ_across_ranks_dynamic(((), kwargs))
    net(**kwargs)
    reduce_the_final_bucket(report)


if __name__ == "__main__":
    run_worker("dc_inputs_differ_across_ranks", main, hard_exit=True)  # gloo on CPU: see founding_common.run_worker
