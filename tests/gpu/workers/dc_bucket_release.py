"""Worker for test_deepcompile_bucket_release.py (run it with torchrun on 2 GPUs).

Trains a small bf16 model with ZeRO stage 1, 2 or 3 twice on identical data: first eagerly (the
reference), then with DeepCompile. The DeepCompile run goes through what used to leave
DeepCompile's shared gradient reduce buckets allocated, or released while still needed:

variant "interleaved" (four Linear layers in one graph), in one sequence:
* gradient accumulation (2 micro-batches per optimizer step),
* forwards under torch.no_grad() after training, which recompile the frame,
* engine.eval() with no_grad and inference_mode forwards, then engine.train(),
* a forward whose backward never comes,
* a new sequence length (recompilation for new shapes), then the old one again;

variant "param_free_first_graph": the first compiled graph uses no parameter (input scaling and a
positional add before a graph break), so its backward has nothing to reduce; training steps, a
no_grad forward and a new sequence length.

Just before every optimizer step the worker records the allocated memory and how many live
allocations have exactly the size of a reduce bucket; it counts them also during each boundary
backward, when the gradient of the input is produced (after every graph has reduced). Each rank
writes a JSON report to the path
given by $DIST_RESULT_DIR (rewritten after every operation, so a rank that dies still leaves the
operation it reached).
"""

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

import ds_configs

HIDDEN = 2048
N_LAYERS = 4
MICRO_BATCH = 4
SEQ = 16
SEQ_NEW = 24
GAS = 2
LR = 1e-3
# Elements per reduce bucket of the DeepCompile run. The eager reference uses another size, so
# that nothing it may leave allocated can be mistaken for a DeepCompile bucket.
BUCKET_ELEMS = 50_000_000
EAGER_BUCKET_ELEMS = 40_000_000

# (operation, sequence length). "train" is one micro-batch: forward, backward, engine.step();
# the optimizer steps on every GAS-th one.
INTERLEAVED_PLAN = [
    ("train", SEQ),
    ("train", SEQ),  # optimizer step 1
    ("train", SEQ),
    ("train", SEQ),  # optimizer step 2
    ("no_grad", SEQ),
    ("no_grad", SEQ),
    ("no_grad", SEQ),
    ("train", SEQ),
    ("train", SEQ),  # optimizer step 3
    ("eval_mode", None),
    ("no_grad", SEQ),
    ("inference_mode", SEQ),
    ("train_mode", None),
    ("no_backward", SEQ),
    ("train", SEQ_NEW),
    ("train", SEQ_NEW),  # optimizer step 4, new shape
    ("train", SEQ),
    ("train", SEQ),  # optimizer step 5
]
# ZeRO-3 DeepCompile switches to another pass schedule at step 5 (WARMUP); the plans stop there.

PARAM_FREE_FIRST_GRAPH_PLAN = [
    ("train", SEQ),
    ("train", SEQ),  # optimizer step 1
    ("no_grad", SEQ),
    ("train", SEQ),
    ("train", SEQ),  # optimizer step 2
    ("train", SEQ_NEW),
    ("train", SEQ_NEW),  # optimizer step 3, new shape
]

VARIANTS = {
    "interleaved": (False, INTERLEAVED_PLAN),
    "param_free_first_graph": (True, PARAM_FREE_FIRST_GRAPH_PLAN),
}


class Net(nn.Module):

    def __init__(self, param_free_first_graph):
        super().__init__()
        self.param_free_first_graph = param_free_first_graph
        self.register_buffer("pos", torch.linspace(-0.5, 0.5, HIDDEN))
        self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(N_LAYERS)])

    def forward(self, x, y):
        h = x
        if self.param_free_first_graph:
            # The first compiled graph uses no parameter: its backward reduces nothing.
            h = h * 0.5 + self.pos.to(h.dtype)
            torch._dynamo.graph_break()
        # No graph break inside this loop: Dynamo would skip the whole frame and run it eagerly,
        # which DeepCompile does not support (its ZeRO hooks are gone).
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i + 1 < len(self.layers):
                h = torch.relu(h)
        return F.mse_loss(h.float(), y.float())


def make_batch(rank, index, seq, device):
    gen = torch.Generator().manual_seed(1000 * (rank + 1) + index)
    x = torch.randn(MICRO_BATCH, seq, HIDDEN, generator=gen)
    y = 0.5 * x.roll(1, dims=-1)
    return x.to(device, torch.bfloat16), y.to(device, torch.bfloat16)


def ds_config(stage, deepcompile):
    return ds_configs.zero(stage, MICRO_BATCH, GAS, LR, deepcompile=deepcompile,
                           reduce_bucket_size=BUCKET_ELEMS if deepcompile else EAGER_BUCKET_ELEMS)


def bucket_sizes_bytes():
    # A bucket holds gradients of one dtype: bf16 here, fp32 if grads were upcast.
    return {BUCKET_ELEMS * 2, BUCKET_ELEMS * 4}


def count_live_blocks(sizes, device_index):
    count = 0
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg.get("device", device_index) != device_index:
            continue
        for block in seg["blocks"]:
            if block["state"] == "active_allocated" and block.get("requested_size", block["size"]) in sizes:
                count += 1
    return count


def mib(nbytes):
    return round(nbytes / 2**20, 1)


class Reporter:

    def __init__(self, path, payload):
        self.path = path
        self.payload = payload

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.payload, f, indent=1)
        os.replace(tmp, self.path)


def run(stage, variant, deepcompile, rank, device, rec, reporter):
    import deepspeed

    param_free_first_graph, plan = VARIANTS[variant]
    torch.manual_seed(0)
    model = Net(param_free_first_graph)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(stage, deepcompile))
    if deepcompile:
        engine.compile()

    device_index = torch.cuda.current_device()
    sizes = bucket_sizes_bytes()
    if deepcompile:
        optimizer = engine.optimizer
        original_step = optimizer.step

        def step_with_probe(*args, **kwargs):
            torch.cuda.synchronize()
            rec["mib_before_step"].append(mib(torch.cuda.memory_allocated()))
            rec["bucket_blocks_before_step"].append(count_live_blocks(sizes, device_index))
            return original_step(*args, **kwargs)

        optimizer.step = step_with_probe

    for index, (op, seq) in enumerate(plan):
        rec["reached"] = f"{index}:{op}"
        reporter.write()
        if op == "train":
            x, y = make_batch(rank, index, seq, device)
            # Makes the first graph need a backward (it is parameter-free in one variant), and
            # gives a point late in the backward to look at the buckets from.
            x.requires_grad_(True)
            boundary = engine.is_gradient_accumulation_boundary()
            if deepcompile and boundary:
                x.register_hook(
                    lambda grad: rec["bucket_blocks_in_backward"].append(count_live_blocks(sizes, device_index)))
            loss = engine(x, y)
            engine.backward(loss)
            if deepcompile and boundary:
                torch.cuda.synchronize()
                rec["bucket_blocks_after_backward"].append(count_live_blocks(sizes, device_index))
            engine.step()
            rec["train_losses"].append(loss.item())
        elif op in ("no_grad", "inference_mode"):
            x, y = make_batch(rank, index, seq, device)
            # The eager reference only needs the numbers; no_grad gives the same ones there.
            ctx = torch.inference_mode() if op == "inference_mode" and deepcompile else torch.no_grad()
            with ctx:
                loss = engine(x, y)
            rec["eval_losses"].append(loss.item())
        elif op == "no_backward":
            x, y = make_batch(rank, index, seq, device)
            loss = engine(x, y)
            rec["eval_losses"].append(loss.item())
            del loss
        elif op == "eval_mode":
            engine.eval()
        elif op == "train_mode":
            engine.train()
        else:
            raise ValueError(op)
        torch.cuda.synchronize()
        rec["mib_after_op"].append(mib(torch.cuda.memory_allocated()))

    rec["reached"] = "done"
    reporter.write()
    engine.destroy()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True, choices=[1, 2, 3])
    parser.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    parser.add_argument("--skip-eager", action="store_true")
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    import deepspeed
    deepspeed.init_distributed()

    payload = {
        "rank": rank,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "stage": args.stage,
        "variant": args.variant,
        "gradient_accumulation_steps": GAS,
        "deepspeed_version": deepspeed.__version__,
        "deepspeed_file": deepspeed.__file__,
        "torch_version": torch.__version__,
        "bucket_elems": BUCKET_ELEMS,
        "bucket_mib": mib(BUCKET_ELEMS * 2),
        "plan": [list(p) for p in VARIANTS[args.variant][1]],
        "error": None,
    }
    path = os.path.join(os.environ["DIST_RESULT_DIR"], f"rank{rank}.json")
    reporter = Reporter(path, payload)

    def new_record():
        return {
            "reached": None,
            "seconds": None,
            "train_losses": [],
            "eval_losses": [],
            "mib_after_op": [],
            "mib_before_step": [],
            "bucket_blocks_before_step": [],
            "bucket_blocks_in_backward": [],
            "bucket_blocks_after_backward": [],
        }

    try:
        for name, deepcompile in (("eager", False), ("deepcompile", True)):
            if name == "eager" and args.skip_eager:
                continue
            rec = payload[name] = new_record()
            start = time.time()
            run(args.stage, args.variant, deepcompile, rank, device, rec, reporter)
            rec["seconds"] = round(time.time() - start, 1)
            reporter.write()
            gc.collect()
            torch.cuda.empty_cache()
    except BaseException:
        payload["error"] = traceback.format_exc()
        reporter.write()
        print(f"[rank {rank}] worker failed:\n{payload['error']}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Leave at once: the other rank may be blocked in a collective, torchrun stops it.
        os._exit(1)

    torch.distributed.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
