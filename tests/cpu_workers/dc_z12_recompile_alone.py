"""Worker for tests/test_deepcompile_z12_recompiles_alone.py: one rank of two recompiles a graph under DeepCompile
ZeRO-1/2 while the other goes on to the step's gradient reduction, on CPU (gloo, DS_ACCELERATOR=cpu).

With the HF Trainer's dynamic padding each rank's micro-batch has a length of its own, so Dynamo recompiles on one rank
and not on another (2xH200, the zoo's Trainer cell: rank 0 profiling a new forward graph, rank 1 in backward reducing
gradients, both waiting for ever; #7611). Here rank 0 runs DeepCompile's passes over a new graph (run_opt_passes,
with the ZeRO-1 or ZeRO-2 schedule; the gradient rewrite itself, which needs real parameters, is replaced by the
identity: what is checked is what DeepCompile does around it) and rank 1 does not; then both all-reduce a gradient
bucket. Every collective has a 60 s timeout. Prints one line "DC_Z12_RECOMPILE <json>": per stage, the reduced
bucket's value on each rank or the error that rank raised.
"""

import datetime
import json
import os
import socket
import subprocess
import sys

PREFIX = "DC_Z12_RECOMPILE "


def rank_main(rank, stage):
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.compile import backend
    from deepspeed.compile.passes import zero_1_and_2_compile as z12
    from deepspeed.compile.profilers import ProfilingResult

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    # The profiler puts its collectives' tensors on torch.device(current_device()); the CPU accelerator's is 0.
    accelerator = deepspeed.accelerator.get_accelerator()
    accelerator.current_device = lambda: "cpu"
    z12.add_z1_reduce_fw = lambda gm, *args, **kwargs: gm
    opt_pass = {"1": z12.add_z1_reduce, "2": z12.add_z2_reduce}[stage]
    backend.init_schedule([(0, [opt_pass])])
    out = {}
    try:
        if rank == 0:
            gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
            x = torch.randn(4, 8)
            backend.run_opt_passes([opt_pass], gm, 7, [], {7: ProfilingResult()}, lambda: (x, ), 0.0, {}, bwd=False)
        bucket = torch.full((1024, ), float(rank + 1))
        dist.all_reduce(bucket)
        out["reduced"] = bucket[0].item()
    except Exception as exc:  # noqa: BLE001 (the report says what the rank raised)
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(PREFIX + json.dumps(out), flush=True)
    os._exit(0)  # a rank left in a broken collective would otherwise wait for the other at exit


def main():
    if len(sys.argv) > 2:
        return rank_main(int(sys.argv[1]), sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = {}
    for stage in ("1", "2"):
        procs = [
            subprocess.Popen([sys.executable, __file__, str(rank), stage], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port + int(stage))))
            for rank in range(2)
        ]
        ranks = []
        for p in procs:
            try:
                stdout, _ = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, _ = p.communicate()
            lines = [line for line in stdout.splitlines() if line.startswith(PREFIX)]
            ranks.append(json.loads(lines[-1][len(PREFIX):]) if lines else {"error": f"no report, exit {p.returncode}"})
        report[f"zero{stage}"] = ranks
    print(PREFIX + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
