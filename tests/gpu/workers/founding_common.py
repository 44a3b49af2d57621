"""Helpers shared by the founding-fix workers (tests/gpu/workers/founding_*.py).

A worker is started by tests/gpu/test_founding_fixes.py through tests/gpu/dist.py (torchrun, one
process per GPU; each rank writes one JSON report to $DIST_RESULT_DIR/rank<RANK>.json), or by hand:

    torchrun --standalone --nproc_per_node=2 tests/gpu/workers/founding_z3_release.py
    python tests/gpu/workers/founding_z3_release.py          # one process, rank 0 of 1

Without $DIST_RESULT_DIR the report is printed to stdout as one line starting with REPORT_PREFIX.
"""

import json
import math
import os
import socket
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist import RESULT_DIR_ENV, result_path  # noqa: E402  (tests/gpu/dist.py)

REPORT_PREFIX = "FOUNDING_REPORT "
MIB = 2**20


def ensure_dist_env():
    """Fill in the torchrun environment for a worker started as a plain single process."""
    if "RANK" in os.environ:
        return False
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return True


def init_distributed(backend):
    """deepspeed.init_distributed(backend), and the process group destroyed when the process ends (atexit, while the
    interpreter is whole): a gloo group left to the interpreter's shutdown may abort the process there, after its
    work is done and reported (exit -6, "terminate called without an active exception":
    https://github.com/pytorch/pytorch/issues/190489). Workers started through run_worker destroy it themselves."""
    import atexit
    import deepspeed
    import torch.distributed as torch_dist
    deepspeed.init_distributed(dist_backend=backend)
    atexit.register(lambda: torch_dist.is_initialized() and torch_dist.destroy_process_group())


def mib(nbytes):
    return round(nbytes / MIB, 2)


def finite(values):
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


# After its deadline a rank lives this long, so that the other ranks, whose deadlines started a little later, write
# their stacks too: the first rank to leave makes torchrun stop the others (2xH200: rank 1's stacks were lost so).
# DIST_DEADLINE_GRACE_S sets it for workers whose ranks' deadlines lie a known few seconds apart (the CPU suite's
# tests of the dumps themselves, which otherwise wait out the 30 s).
DEADLINE_GRACE_S = float(os.environ.get("DIST_DEADLINE_GRACE_S", 30))
# faulthandler writes the stacks only if the watchdog thread has not this long after the deadline: a thread that
# holds the GIL (a C loop that never releases it) keeps the watchdog from running.
FAULTHANDLER_AFTER_S = 5
_deadline = None


def _format_stacks(seconds):
    """Every thread's Python stack, the main thread's first (the one a worker runs in), innermost frame first, in
    faulthandler's layout (tools/zoo-table reads it)."""
    import threading
    names = {t.ident: t.name for t in threading.enumerate()}
    main, me = threading.main_thread().ident, threading.get_ident()
    frames = sorted(((ident, frame) for ident, frame in sys._current_frames().items() if ident != me),
                    key=lambda item: item[0] != main)
    blocks = [f"Deadline ({seconds:.0f} s) passed: every thread's Python stack, most recent call first."]
    for ident, frame in frames:
        lines = [f"Thread 0x{ident:016x} ({names.get(ident, '?')}) (most recent call first):"]
        stack = reversed(traceback.extract_stack(frame))
        lines += [f'  File "{f.filename}", line {f.lineno} in {f.name}' for f in stack]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def stacks_at_deadline(seconds):
    """Past `seconds`, write every thread's Python stack, and DEADLINE_GRACE_S later end the process (SIGALRM, whose
    default action needs no Python code to run): a hang becomes a failure with every rank's stacks. Under
    tests/gpu/dist.py they go to $DIST_RESULT_DIR/rank<RANK>.stacks, which the launcher returns per rank (on a
    shared stderr the ranks' dumps interleave and an output tail keeps the outermost frames of one); by hand, to
    stderr.

    A watchdog thread writes them from sys._current_frames(), under the GIL, the main thread's first. faulthandler,
    which reads the other threads' frames while they run, crashed a rank in the middle of its dump (4xH100, zoo run
    12: SIGSEGV while printing a thread that was reading os.environ), and printed the main thread last, so that a
    dump cut to its first characters lost it; it is kept only for a process whose GIL the watchdog never gets."""
    import faulthandler
    import signal
    import threading
    global _deadline
    path = os.environ.get(RESULT_DIR_ENV)
    out = open(os.path.join(path, f"rank{os.environ.get('RANK', '0')}.stacks"), "w") if path else sys.stderr

    def dump():
        out.write(_format_stacks(seconds))
        out.flush()
        faulthandler.cancel_dump_traceback_later()

    _deadline = threading.Timer(seconds, dump)
    _deadline.daemon = True
    _deadline.name = "stacks-at-deadline"
    _deadline.start()
    faulthandler.dump_traceback_later(seconds + FAULTHANDLER_AFTER_S, exit=False, file=out)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(int(seconds + DEADLINE_GRACE_S + 1))


def cancel_deadline():
    """The worker's work is done: no stacks. Its SIGALRM stays, so that a teardown that hangs still ends."""
    import faulthandler
    if _deadline is not None:
        _deadline.cancel()
    faulthandler.cancel_dump_traceback_later()


class Report(dict):
    """The rank's JSON report; rewritten after every phase so that a rank that dies leaves its progress."""

    def __init__(self, fix, **fields):
        super().__init__(fix=fix, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), error=None)
        self.update(fields)
        self.path = result_path(self["rank"]) if os.environ.get(RESULT_DIR_ENV) else None

    def write(self):
        if self.path is None:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self, f, indent=1)
        os.replace(tmp, self.path)

    def publish(self):
        self.write()
        if self.path is None:
            print(REPORT_PREFIX + json.dumps(self), flush=True)


def setup_device():
    """Bind this rank to its GPU and start torch.distributed (NCCL) through deepspeed."""
    import torch
    import deepspeed

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    return torch.device("cuda", local_rank)


def describe(report):
    import torch
    import deepspeed

    report["deepspeed_version"] = deepspeed.__version__
    report["deepspeed_file"] = deepspeed.__file__
    report["torch_version"] = torch.__version__
    report["device_name"] = torch.cuda.get_device_name()


def answer_inductors_padding_benchmark(pads):
    """Stand in for the benchmark that Inductor's pad_mm pass times on this process's GPU to decide whether padding a
    matmul of odd size is faster (torch 2.11 and 2.15: pad_mm._should_pad; 2.8: pad_mm.should_pad_bench): answer
    `pads` to every question. Returns the list of answers given, one a question."""
    import torch._inductor.fx_passes.pad_mm as pad_mm
    asked = []

    def answer(*args, **kwargs):
        asked.append(pads)
        return pads

    setattr(pad_mm, "_should_pad" if hasattr(pad_mm, "_should_pad") else "should_pad_bench", answer)
    return asked


def reduce_the_final_bucket(report):
    """A CPU worker's last collective, which tests/cpu_worker.run_two_ranks checks: rank r all-reduces a bucket of
    r + 1s. 3.0 on both ranks means that it met the other rank's bucket, not a stray collective of one rank."""
    import torch
    import deepspeed.comm as dist
    bucket = torch.full((1024, ), float(report["rank"] + 1))
    dist.all_reduce(bucket)
    report["reduced"] = bucket[0].item()


def run_worker(fix, main, hard_exit=False, **fields):
    """Run ``main(report)``; on any exception record the traceback and leave at once with status 1. hard_exit: once
    the report is out, leave without the interpreter's teardown (os._exit(0)). The CPU workers on gloo take it: a
    C++ thread of the CPU accelerator's communication op now and then ends the process in that teardown with
    "terminate called without an active exception" (about one run in ten, after both ranks had reported)."""
    standalone = ensure_dist_env()
    report = Report(fix, standalone=standalone, **fields)
    start = time.time()
    try:
        main(report)
    except BaseException:
        report["error"] = traceback.format_exc()
        report["seconds"] = round(time.time() - start, 1)
        report.publish()
        print(f"[rank {report['rank']}] worker failed:\n{report['error']}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Leave now: the other rank may be blocked in a collective; torchrun stops it.
        os._exit(1)
    report["seconds"] = round(time.time() - start, 1)
    report.publish()
    try:
        import torch.distributed as torch_dist
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if hard_exit:
        os._exit(0)
