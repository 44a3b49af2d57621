"""The model zoo: Hugging Face model families under DeepCompile ZeRO-1/2/3, through the loop a Trainer user runs.

Every zoo model (tests/gpu/zoo_models.py) x ZeRO stage 1, 2, 3 runs workers/zoo_cell.py twice, eagerly (the
reference) and with DeepCompile, each cell a process of its own, all side by side on one GPU (ZOO_PARALLEL at
once). A DeepCompile cell that finished is resumed from its checkpoint in a new process (every model at ZeRO-3,
the Llama row at every stage: see _resumed). Plain engine.compile()
of each model at stage 1 measures the spread that the loss tolerance must cover. The Trainer runs the zoo's
Llama with torch_compile=True, with and without DeepCompile (workers/zoo_trainer.py).

Checked per DeepCompile cell: no error; training, evaluation (no_grad with labels, inference_mode logits) within
the model's tolerance of eager DeepSpeed; allocated memory before each optimizer step flat once warm; no ZeRO-3
parameter left gathered after a step; no new Dynamo graph nor DeepCompile profiling run for a new sequence length
once warm; no backward compiled ahead of its run dropped; the resumed engine's losses equal the uninterrupted ones;
greedy generate() with the KV cache works.

GPU_TEST_REPORT_DIR keeps every cell's JSON report and the summary zoo-<deepspeed version>.json that
tools/zoo-table renders for docs/model-zoo.md. ZOO_REPLAY=<that summary> applies the checks to a recorded run
instead of running the cells (any host); several summaries joined by ':' are merged, a later one's cells replacing
an earlier one's. ZOO_CELLS=<regular expression> runs only the cells whose key (kind/model/stage/mode, e.g.
cell/llama_ckpt/3/deepcompile or cell/qwen2_moe/1,2,3/eager) it matches, with the resumes of those that qualify: a
second run for the cells a first one could not finish, replayed together with it. ZOO_COMPILE=<JSON> adds options to
DeepCompile's `compile` section of every DeepCompile cell and Trainer run (e.g. '{"compile_blocks_once": true}').

ZOO_RANKS=2 (or 4) runs every cell on that many GPUs, one process a rank (the summary is then
zoo-<version>-ranks2.json): each rank gets micro-batches of its own lengths and padding in the same step, the checks
apply to every rank, and the Llama row adds ZeRO-2 with overlap_comm and contiguous_gradients on and off (stages
2+oc, 2-cg, 2+oc-cg). At any world size the global gradient norm of every step must agree across eager ZeRO-1/2/3 and
DeepCompile, and every rank's cell has a deadline past which it prints its Python stacks and fails
(ZOO_CELL_DEADLINE_S; ZOO_RESUME_DEADLINE_S for the resumes, the same by default).
"""

import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time

import pytest

from dist import STACKS_CHARS, DistJob, skip_reason

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_models import ZOO  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CELL = os.path.join(HERE, "workers", "zoo_cell.py")
TRAINER = os.path.join(HERE, "workers", "zoo_trainer.py")
STAGES = (1, 2, 3)
RANKS = int(os.environ.get("ZOO_RANKS", "1"))
# ZeRO-2 with its gradient-reduction options changed (workers/zoo_cell.py's stage names), on this row, at several ranks.
Z2_VARIANTS, Z2_VARIANT_MODEL = (("2+oc", "2-cg", "2+oc-cg") if RANKS > 1 else ()), "llama"
TRAINER_STAGES = (1, 3)
PARALLEL = int(os.environ.get("ZOO_PARALLEL", "14"))  # ZOO_MODELS=a,b runs only those rows
CELL_DEADLINE_S = float(os.environ.get("ZOO_CELL_DEADLINE_S", "360"))
# A resume starts when its cell ends, late in a run: a deadline of its own lets a stuck one dump its stacks before the
# suite's timeout (a zoo run: three resumes still running at the timeout, no stacks).
RESUME_DEADLINE_S = float(os.environ.get("ZOO_RESUME_DEADLINE_S", str(CELL_DEADLINE_S)))
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Allocated memory before the optimizer step may move by this much once warm (allocator rounding of small tensors).
MEM_SLACK_B = int(os.environ.get("ZOO_MEM_SLACK_B", str(64 * 1024)))
BLOCKS_ONCE = bool(json.loads(os.environ.get("ZOO_COMPILE") or "{}").get("compile_blocks_once"))
# A resumed engine runs the same compiled code on the same state: its losses match to bf16 rounding.
RESUME_RTOL = 1e-3
RESUME_ALL_STAGES = "llama"
EAGER_STAGES = ",".join(map(str, STAGES))
# The global gradient norm of a step, against eager ZeRO-1's: a stage that reduces gradients wrongly (a missing or
# doubled division by the world size, #7718) is off by a factor of 2 or more; bf16 rounding moves it by well under 1 %.
NORM_RTOL_MIN = 1e-2


def _stages(model):
    """The stages (workers/zoo_cell.py's names) a model's DeepCompile and eager cells run."""
    return STAGES + (Z2_VARIANTS if model == Z2_VARIANT_MODEL else ())


def _stage_no(stage):
    return int(str(stage)[0])


def _cells():
    cells = []
    models = [m for m in os.environ.get("ZOO_MODELS", "").split(",") if m] or list(ZOO)
    for model in models:
        cells += [("cell", model, stage, "deepcompile") for stage in _stages(model)]
        # The eager references compile nothing: one process runs the three stages in turn.
        cells += [("cell", model, EAGER_STAGES, "eager"), ("cell", model, 1, "compile")]
        cells += [("cell", model, v, "eager") for v in _stages(model)[len(STAGES):]]
    # On several ranks the Trainer's sampler gives each rank other rows, padded to other lengths.
    cells += [("trainer", "llama", stage, mode) for stage in TRAINER_STAGES for mode in ("deepcompile", "eager")]
    only = os.environ.get("ZOO_CELLS")
    if only:
        cells = [c for c in cells if re.search(only, "/".join(map(str, c)))]
        assert cells, f"ZOO_CELLS={only!r} matches no cell"
    # Longest first: DeepCompile ZeRO-3 (activation checkpointing compiles the most graphs) and the Trainer; then the
    # spread cells, which every loss check needs, before the quick eager ones.
    return sorted(cells, key=lambda c: (c[3] != "deepcompile", -max(map(_stage_no, str(c[2]).split(","))),
                                        "ckpt" not in c[1], c[0] != "trainer", c[3] != "compile"))


def _resumed(key):
    """Which DeepCompile cells are resumed in a new process: every model at ZeRO-3, whose checkpoint holds the
    partitioned parameters and DeepCompile resumes past its WARMUP recompile, and the first row at ZeRO-1 and -2
    (ZeRO-1/2 checkpoints do not depend on the model family). Resuming all 27 cells does not fit one 10-minute run."""
    _, model, stage, _ = key
    return stage == 3 or (model == RESUME_ALL_STAGES and stage in STAGES)


def _job(key, tmp):
    kind, model, stage, mode = key[:4]
    ckpt = os.path.join(tmp, f"{model}-z{stage}-{mode}")
    deadline = RESUME_DEADLINE_S if kind == "resume" else CELL_DEADLINE_S
    args = ["--stage", stage, "--mode", mode, "--deadline", deadline]
    if kind == "trainer":
        return DistJob(TRAINER, args + ["--out", ckpt], nprocs=RANKS, timeout=deadline + 60, env=ENV)
    args += ["--model", model, "--ckpt", ckpt]
    if kind == "resume":
        args += ["--phase", "resume"]
    return DistJob(CELL, args, nprocs=RANKS, timeout=deadline + 60, env=ENV)


def _run_all(cells, tmp, on_result):
    """Run every cell, PARALLEL at a time; queue a finished DeepCompile cell's resume."""
    queue, running, results = list(cells), {}, {}
    while queue or running:
        while queue and len(running) < PARALLEL:
            key = queue.pop(0)
            running[key] = _job(key, tmp).start()
        for key, job in list(running.items()):
            if job.done():
                res = results[key] = job.wait()
                del running[key]
                on_result(key, res)
                rec = res.results.get(0, {}).get("cells", {}).get(str(key[2]), {})
                if key[0] == "cell" and key[3] == "deepcompile" and rec.get("reached") == "done" and _resumed(key):
                    queue.insert(0, ("resume", ) + key[1:])
        time.sleep(0.5)
    return results


def _summaries(key, res):
    """One summary per stage the job ran (an eager job runs several), under the key of that stage's cell; on several
    ranks rank 0's report, with the other ranks' records of the cell under "rank_cells"."""
    reports = [res.results.get(r, {}) for r in range(RANKS)]
    report = reports[0]
    error = next((r["error"] for r in reports if r.get("error")), None)
    stages = [_key_stage(s) for s in str(key[2]).split(",")]
    out = {}
    for stage in stages:
        recs = [r.get("cells", {}).get(str(stage)) or (r.get("cell", {}) if key[0] == "trainer" else {})
                for r in reports]
        rec = recs[0]
        ok = res.ok and error is None and (key[0] == "trainer" or all(r.get("reached") == "done" for r in recs))
        summary = {"ok": ok, "seconds": rec.get("seconds", round(res.duration_s, 1)),
                   "report": dict(report, cell=rec, cells=None, rank_cells=recs[1:])}
        if not ok:
            summary["error"] = (error.strip().splitlines()[-1] if error else res.summary())[:300]
            summary["reached"] = rec.get("reached")
            summary["output_tail"] = error if error else res.tail(60)
        if not ok and len(recs) > 1:
            summary["reached"] = [r.get("reached") for r in recs]
        if not ok and res.stacks:  # where each rank was when its deadline passed, innermost frames first
            summary["stacks"] = {str(r): text[:STACKS_CHARS] for r, text in sorted(res.stacks.items())}
        out[key[:2] + (stage, ) + key[3:]] = summary
    return out


def _key_stage(stage):
    """A cell key's stage: an int for 1, 2, 3 (the keys of recorded runs), the name for a ZeRO-2 variant."""
    return int(stage) if str(stage).isdigit() else str(stage)


def _replayed(paths):
    """The cells of recorded runs (their zoo-<version>.json, joined by ':'; a later run's cell replaces an earlier
    one's), keyed as the checks look them up: the checks applied on any host, the cells not run again."""
    cells = {}
    for path in paths.split(":"):
        with open(path) as f:
            cells.update(json.load(f)["cells"])
    return {(kind, model, _key_stage(stage), mode): res
            for (kind, model, stage, mode), res in ((k.split("/"), v) for k, v in cells.items())}


@pytest.fixture(scope="module")
def zoo():
    replay = os.environ.get("ZOO_REPLAY")
    if replay:
        return _replayed(replay)
    reason = skip_reason(RANKS)
    if reason:
        pytest.skip(reason)
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not importable")
    import deepspeed

    tmp = tempfile.mkdtemp(prefix="zoo_")
    start = time.time()
    results = {}
    report_dir = os.environ.get("GPU_TEST_REPORT_DIR")

    def on_result(key, res):
        for cell, summary in _summaries(key, res).items():
            results[cell] = summary
            print(f"zoo {time.time() - start:6.1f}s {'/'.join(map(str, cell))}: "
                  f"{'ok' if summary['ok'] else summary['error']}", flush=True)
        if report_dir:  # rewritten after every cell, so that a run cut short still leaves its table
            os.makedirs(report_dir, exist_ok=True)
            name = "zoo-" + deepspeed.__version__.replace("+", "-") + (f"-ranks{RANKS}" if RANKS > 1 else "") + ".json"
            with open(os.path.join(report_dir, name), "w") as f:
                json.dump({"deepspeed": deepspeed.__version__, "wall_s": round(time.time() - start, 1), "ranks": RANKS,
                           "cells": {"/".join(map(str, k)): v for k, v in results.items()}}, f, indent=1)

    try:
        _run_all(_cells(), tmp, on_result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _ranks(zoo, key):
    """Every rank's record of the cell (one on one GPU), after checking it ran the whole loop."""
    res = zoo.get(key)
    assert res is not None, f"{key} never ran"
    print(json.dumps({k: v for k, v in res.items() if k != "report"}, indent=1))
    assert res["ok"], f"{key}: {res['error']}\n{res.get('output_tail', '')}"
    recs = [res["report"]["cell"]] + (res["report"].get("rank_cells") or [])
    assert [r["reached"] for r in recs] == ["done"] * len(recs), [r["reached"] for r in recs]
    return recs


def _cell(zoo, key):
    return _ranks(zoo, key)[0]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-6)


def _assert_close(name, got, want, rtol):
    assert len(got) == len(want), f"{name}: {len(got)} values, reference has {len(want)}"
    worst = max((_rel(a, b) for a, b in zip(got, want)), default=0.0)
    assert worst <= rtol, f"{name} differ by {worst:.3g} (relative; bound {rtol}):\n got {got}\nwant {want}"


def _no_new_compiles(name, snapshots):
    first, last = snapshots[0], snapshots[-1]
    assert first == last, (f"{name}: a new sequence length compiled again ({first} -> {last} over "
                           f"{len(snapshots)} micro-batches of new lengths)")


MODEL_STAGES = [(m, s) for m in sorted(ZOO) for s in _stages(m)]


@pytest.mark.parametrize("model,stage", MODEL_STAGES)
def test_deepcompile_runs_the_user_loop_like_eager(zoo, model, stage):
    eagers = _ranks(zoo, ("cell", model, stage, "eager"))
    dcs = _ranks(zoo, ("cell", model, stage, "deepcompile"))
    if len(dcs) > 1:  # the ranks' micro-batches of one step have lengths of their own, as each rank's collator pads
        same = [ls for ls in zip(*(r["lengths"] for r in dcs)) if len(set(ls)) < len(ls)]
        assert not same, f"ranks trained on micro-batches of the same length: {same}"
    tol = ZOO[model].loss_tol
    for rank, (eager, dc) in enumerate(zip(eagers, dcs)):
        at = f"rank {rank}: " if len(dcs) > 1 else ""
        assert dc["deepcompile_active"], "DeepCompile was not active"
        if BLOCKS_ONCE:
            assert dc.get("region_blocks"), f"{at}compile_blocks_once made no block a compile region"
        _assert_close(at + "training losses", dc["losses"], eager["losses"], tol)
        _assert_close(at + "evaluation losses", dc["eval_losses"], eager["eval_losses"], tol)
        _assert_close(at + "inference logits (mean |logit|)", [dc["eval_logits_mean_abs"]],
                      [eager["eval_logits_mean_abs"]], tol)
        # Warm: after DeepCompile ZeRO-3 recompiles with prefetching at its WARMUP step (5), the last 3 of 8 steps.
        warm = dc["mem_before_step"][-3:]
        assert max(warm) - min(warm) <= MEM_SLACK_B, (
            f"{at}allocated memory before each step grows: {dc['mem_before_step']}")
        assert not any(dc["gathered_after_step"]), (
            f"{at}ZeRO-3 parameters left gathered after steps: {dc['gathered_after_step']}")
        # Greedy decoding from the same weights gives the same tokens (every cell of the recorded runs in docs/).
        assert dc["generated"] and dc["generated"] == eager["generated"], (
            f"{at}generate(): deepcompile {dc['generated']}, eager {eager['generated']}")


@pytest.mark.parametrize("model,stage", MODEL_STAGES)
def test_deepcompile_keeps_the_backward_compiled_ahead_of_its_run(zoo, model, stage):
    """With new sequence lengths AOTAutograd compiles a backward that saves symbolic sizes before it first runs, under
    its fake mode. A DeepCompile pass failing there (0.19.8's selective_gather read free memory into a fake tensor) is
    logged and swallowed: the backward is profiled and compiled again at its first run, and the error's traceback
    keeps the first profiling's inputs alive until the garbage collector runs."""
    for rank, dc in enumerate(_ranks(zoo, ("cell", model, stage, "deepcompile"))):
        if "dropped_backward_compiles" not in dc:
            pytest.skip("a recorded run from before the cell kept AOTAutograd's dropped backward compiles")
        assert not dc["dropped_backward_compiles"], (
            f"rank {rank}: AOTAutograd dropped DeepCompile's backward compiled ahead of its run: "
            f"{dc['dropped_backward_compiles']}")


@pytest.mark.parametrize("model", sorted(ZOO))
def test_global_grad_norm_agrees_across_stages_and_modes(zoo, model):
    """The gradient norm every step clips by, on every rank, for eager ZeRO-1/2/3 and DeepCompile, against eager
    ZeRO-1's: the same model, data and seed must give the same global norm whatever the stage (#7718, #7749)."""
    ref = _cell(zoo, ("cell", model, 1, "eager"))
    if "grad_norms" not in ref:
        pytest.skip("a recorded run from before the zoo recorded gradient norms")
    want = ref["grad_norms"]
    assert want and None not in want, f"eager ZeRO-1 recorded no gradient norm: {want}"
    rtol = max(NORM_RTOL_MIN, 5 * ZOO[model].loss_tol)
    for stage in _stages(model):
        for mode in ("eager", "deepcompile"):
            for rank, rec in enumerate(_ranks(zoo, ("cell", model, stage, mode))):
                name = f"{mode} ZeRO-{stage} rank {rank} gradient norms (eager ZeRO-1's as reference)"
                assert None not in rec["grad_norms"], f"{name}: {rec['grad_norms']}"
                _assert_close(name, rec["grad_norms"], want, rtol)


@pytest.mark.parametrize("model,stage", MODEL_STAGES)
def test_deepcompile_compiles_are_bounded(zoo, model, stage):
    """New sequence lengths compile no more graphs under DeepCompile than under plain torch.compile (which makes the
    changing dimension dynamic), and once warm none at all."""
    for dc, plain in zip(_ranks(zoo, ("cell", model, stage, "deepcompile")),
                         _ranks(zoo, ("cell", model, 1, "compile"))):
        _compiles_are_bounded(dc, plain)


def _compiles_are_bounded(dc, plain):
    n1, after = len(zoo_models_plan()["train"]), len(zoo_models_plan()["after"])
    # Up to the end of evaluation; DeepCompile ZeRO-3 then recompiles everything once, by design, at its WARMUP step.
    for name, upto in (("compiles", n1), ("eval_compiles", None)):
        dc_graphs = [c["graphs"] for c in dc[name][:upto]]
        plain_graphs = [c["graphs"] for c in plain[name][:upto]]
        assert all(d <= p for d, p in zip(dc_graphs, plain_graphs)), (
            f"{name}: DeepCompile compiled more graphs than plain torch.compile over the same lengths:\n"
            f"deepcompile {dc_graphs}\nplain       {plain_graphs}\n{dc['recompile_reasons']}")
    # A new length under no_grad compiles no more than under plain compile. (With activation checkpointing both
    # compile one more graph at the second evaluation batch: evaluation runs frames that training, checkpointed,
    # never ran, and Dynamo first compiles them for the one length it has seen.)
    dc_new = dc["eval_compiles"][1]["graphs"] - dc["eval_compiles"][0]["graphs"]
    plain_new = plain["eval_compiles"][1]["graphs"] - plain["eval_compiles"][0]["graphs"]
    assert dc_new <= plain_new, (f"evaluation under no_grad, second length: DeepCompile compiled {dc_new} new graphs, "
                                 f"plain torch.compile {plain_new}\n{dc['recompile_reasons']}")
    # Once every frame evaluation runs has seen two lengths, a new one compiles nothing: the last no_grad batch (runs
    # recorded before fork.7 had two no_grad batches, and no such batch).
    n_no_grad = dc.get("eval_no_grad_batches", 2)
    if n_no_grad >= 4:
        _no_new_compiles("evaluation under no_grad, last length", dc["eval_compiles"][n_no_grad - 2:n_no_grad])
    # The last micro-batch before save_checkpoint (past WARMUP) and the new lengths after it.
    _no_new_compiles("training once warm", dc["compiles"][-(after + 1):])
    assert dc["compiles"][-1]["profiling_runs"] <= 2 * dc["compiles"][-1]["graphs"], dc["compiles"][-1]


@pytest.mark.parametrize("model,stage", [(m, s) for m, s in MODEL_STAGES if _resumed(("cell", m, s, "deepcompile"))])
def test_deepcompile_resume_from_checkpoint(zoo, model, stage):
    after = len(zoo_models_plan()["after"])
    rtol = ZOO[model].loss_tol if "dropout" in model else RESUME_RTOL
    for rank, (dc, resumed) in enumerate(zip(_ranks(zoo, ("cell", model, stage, "deepcompile")),
                                             _ranks(zoo, ("resume", model, stage, "deepcompile")))):
        _assert_close(f"rank {rank}: losses after load_checkpoint", resumed["losses"], dc["losses"][-after:], rtol)


@pytest.mark.parametrize("model", sorted(ZOO))
def test_loss_tolerance_covers_compile_spread(zoo, model):
    """The tolerance must cover what plain torch.compile of the same engine already moves the losses by."""
    for rank, (eager, compiled) in enumerate(zip(_ranks(zoo, ("cell", model, 1, "eager")),
                                                 _ranks(zoo, ("cell", model, 1, "compile")))):
        _assert_close(f"rank {rank}: plain compile vs eager losses", compiled["losses"], eager["losses"],
                      ZOO[model].loss_tol)


@pytest.mark.parametrize("stage", TRAINER_STAGES)
def test_trainer_with_deepcompile(zoo, stage):
    """The Trainer drives DeepCompile through training and evaluation like eager DeepSpeed (its wall time against
    plain torch.compile is measured by tools/bench-trainer, not here)."""
    eager = _cell(zoo, ("trainer", "llama", stage, "eager"))
    dc = _cell(zoo, ("trainer", "llama", stage, "deepcompile"))
    print(f"Trainer graphs compiled: deepcompile {dc['compiles']}")
    assert len(dc["eval_losses"]) == len(eager["eval_losses"]) > 0
    _assert_close("Trainer training losses", dc["losses"], eager["losses"], ZOO["llama"].loss_tol)
    _assert_close("Trainer evaluation losses", dc["eval_losses"], eager["eval_losses"], ZOO["llama"].loss_tol)


def zoo_models_plan():
    sys.path.insert(0, os.path.join(HERE, "workers"))
    import zoo_cell
    return zoo_cell.plan()
