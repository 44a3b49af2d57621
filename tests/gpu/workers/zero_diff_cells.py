"""The cells of the eager ZeRO differential suite (tools/zero-diff): which configurations run, fork
against 0.19.8, and why these.

Eleven factors of a ZeRO configuration, each with the levels users set (FACTORS). Their full product is 16,384
configurations, far too many to run twice in ten minutes, so the suite runs a covering design instead: every pair of
levels of any two factors that some valid configuration holds appears in at least one cell (all pairs, strength 2).
Interactions of two options are where defects of this kind have lived (overlap_comm with contiguous gradients
off, bf16 with fp32 accumulation under ZeRO-2, ...); a defect that needs three specific levels can slip through, and
the cells a defect report names can be added to EXTRA_CELLS.

Levels that a configuration ignores are fixed to one value before cells are compared (ZeRO-0 has no buckets, no
overlap and no offload; ZeRO-3 has no reduce_scatter or multi-rank bucket all-reduce switch; DeepSpeed MoE layers run
on ZeRO-0/1/2 and need reduce_scatter; bf16 with fp32 accumulation needs ZeRO), so no pair is required that no
configuration can hold. fp16 needs an accelerator with fp16 (not
DeepSpeed's CPU accelerator). The design is built greedily and deterministically (the configuration covering most
uncovered pairs, first in enumeration order on ties), so the cell list is the same on every host.
"""

import itertools

# factor: levels; the first level is the one a configuration that ignores the factor gets.
FACTORS = {
    "stage": (0, 1, 2, 3),
    "precision": ("bf16", "fp32", "fp16", "bf16_fp32_accum"),
    "overlap_comm": (False, True),
    "contiguous_gradients": (True, False),
    "reduce_scatter": (True, False),
    "multi_rank_bucket_allreduce": (True, False),
    "grad_accum": (1, 2),
    "clip": (0.0, 1.0),
    "frozen": (False, True),
    "offload": ("none", "cpu"),
    "model": ("dense", "moe"),
}
NAMES = tuple(FACTORS)
# Cells run in addition to the design (a configuration a report names, or a patch's path the pairs leave out).
_BF16_CLIP = dict(precision="bf16", overlap_comm=False, contiguous_gradients=True, reduce_scatter=True,
                  multi_rank_bucket_allreduce=True, grad_accum=1, clip=1.0, frozen=False, offload="none", model="dense")
EXTRA_CELLS = (
    # bf16 gradients clipped without offload: the step unscales them as it casts them to fp32, in one pass
    # (zero-step-unscales-gradients-as-it-casts-them); no pair of levels calls for these three together.
    dict(_BF16_CLIP, stage=1),
    dict(_BF16_CLIP, stage=2, overlap_comm=True, grad_accum=2),
    dict(_BF16_CLIP, stage=3),
)

# Cells a fork patch changes on purpose, against a build without it: patch file -> (which cells, why). Such a cell is
# compared through its first optimizer step only (the micro-batches before any update, and that step's gradient norm,
# loss scale and skip), and must differ after it ("by design"); what it must equal instead is the patch's own test.
BY_DESIGN = {
    "zero0-mixed-precision-wrapper-does-not-step-at-construction.patch":
    (lambda cell: cell["stage"] == 0 and cell["precision"] in ("bf16", "fp16"),
     "ZeRO-0's fp16/bf16 wrapper no longer steps the optimizer when built: every update from the first on changes "
     "(tests/test_zero0_optimizer_starts_at_step_zero.py, tests/test_zero_stages_agree.py)"),
}


def by_design(cell, patches):
    """[(patch, why)] of the patches in `patches` (one build has them, the other not) that change `cell` on purpose."""
    return [(p, why) for p, (selects, why) in BY_DESIGN.items() if p in patches and cell.get("client") != "trainer"
            and selects(cell)]


def unexpected(report):
    """The rows of a tools/zero-diff report (0.19.8 first, the fork second) that are neither equal nor a cell a fork
    patch changes on purpose, and by-design cells that came out equal (the patch changed nothing there)."""
    patches = set(report["reports"][1][0]["fork_patches"]) - set(report["reports"][0][0]["fork_patches"])
    designed = {n for n, cell in report["cells"].items() if by_design(cell, patches)}
    return {name: (result, where) for name, result, where in report["rows"]
            if result != ("by design" if name in designed else "equal")}


def normalize(cell):
    """The configuration as DeepSpeed sees it: factors it ignores set to their first level. None if invalid."""
    cell = dict(cell)
    if cell["model"] == "moe" and (cell["stage"] == 3 or not cell["reduce_scatter"]):
        return None  # DeepSpeed MoE: ZeRO-0/1/2, and ZeRO-1/2 assert reduce_scatter
    if cell["stage"] == 0 and cell["precision"] == "bf16_fp32_accum":
        return None  # bf16 without ZeRO accumulates in bf16 (NotImplementedError otherwise)
    if cell["stage"] == 0:
        for name in ("overlap_comm", "contiguous_gradients", "reduce_scatter", "multi_rank_bucket_allreduce",
                     "offload"):
            cell[name] = FACTORS[name][0]
    if cell["stage"] == 3:
        cell["reduce_scatter"] = FACTORS["reduce_scatter"][0]
        cell["multi_rank_bucket_allreduce"] = FACTORS["multi_rank_bucket_allreduce"][0]
    return cell


def name(cell):
    short = {True: "1", False: "0"}
    parts = [f"z{cell['stage']}", cell["precision"]]
    for key, tag in (("overlap_comm", "oc"), ("contiguous_gradients", "cg"), ("reduce_scatter", "rs"),
                     ("multi_rank_bucket_allreduce", "mr")):
        parts.append(tag + short[cell[key]])
    parts += [f"ga{cell['grad_accum']}", "clip" if cell["clip"] else "noclip", "frozen" if cell["frozen"] else "all",
              f"off-{cell['offload']}", cell["model"]]
    return "-".join(parts)


def valid_configurations(fp16=True):
    seen, out = set(), []
    for levels in itertools.product(*FACTORS.values()):
        cell = normalize(dict(zip(NAMES, levels)))
        if cell is None or (cell["precision"] == "fp16" and not fp16):
            continue
        key = tuple(cell[n] for n in NAMES)
        if key not in seen:
            seen.add(key)
            out.append(cell)
    return out


def pairs(cell):
    return {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(NAMES, 2)}


def covering_cells(fp16=True):
    """All-pairs cells over the valid configurations, in the order they were chosen."""
    configs = valid_configurations(fp16)
    index = {}
    masks = []
    for cell in configs:
        mask = 0
        for pair in pairs(cell):
            mask |= 1 << index.setdefault(pair, len(index))
        masks.append(mask)
    uncovered = (1 << len(index)) - 1
    chosen = []
    while uncovered:
        best = max(range(len(configs)), key=lambda i: (bin(masks[i] & uncovered).count("1"), -i))
        chosen.append(configs[best])
        uncovered &= ~masks[best]
    return chosen + [normalize(c) for c in EXTRA_CELLS]


# The Hugging Face Trainer as the client, with the zero_optimization blocks of HF's DeepSpeed documentation ("auto"
# values filled in by the Trainer): how most users run eager ZeRO. The zoo's Llama, padded batches of 32-128 tokens,
# accumulation 2, an evaluation every 2 steps, bf16 (tests/gpu/workers/zero_diff.py, run_trainer_cell).
TRAINER_CELLS = {
    "trainer-hf-zero2": {
        "client": "trainer",
        "stage": 2,
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": "auto",
            "contiguous_gradients": True,
        },
    },
    "trainer-hf-zero3": {
        "client": "trainer",
        "stage": 3,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    },
}


def cells(fp16=True):
    """{name: cell} of the suite: the covering design, then the Trainer cells."""
    return {**{name(c): c for c in covering_cells(fp16)}, **TRAINER_CELLS}


def stage_cells(precision):
    """{name: cell} of one configuration at each ZeRO stage that takes it, in stage order: the same training, which
    every stage must give up to rounding (tests/test_zero_stages_agree.py; reports of ZeRO-2 gradient norms unlike
    ZeRO-1's and ZeRO-3's are upstream #7718 and #4298). HF's documented blocks' options, gradient accumulation 2,
    clipping 1.0."""
    base = dict(precision=precision, overlap_comm=True, contiguous_gradients=True, reduce_scatter=True,
                multi_rank_bucket_allreduce=True, grad_accum=2, clip=1.0, frozen=False, offload="none", model="dense")
    staged = [normalize(dict(base, stage=stage)) for stage in FACTORS["stage"]]
    return {name(c): c for c in staged if c is not None}


def control(fp16=True):
    """The cell the suite's tests perturb (tools/zero-diff --perturb), which must then differ, or the comparison sees
    nothing: the first ZeRO-2 cell in bf16 with gradient accumulation, so that both micro-batches and the step run
    through the buckets, and no fp16 loss scaler can skip the step that shows the perturbation. Chosen from the cells
    of this host (the design with fp16 differs from the one without)."""
    return next(n for n, c in cells(fp16).items()
                if c["stage"] == 2 and c.get("precision") == "bf16" and c.get("grad_accum") == 2)
