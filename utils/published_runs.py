"""Published training runs beside the planner's prediction for the same layout, with the relative error.

    python -m utils.published_runs                 # every run, with where its layout ranks among the planner's
    python -m utils.published_runs --no-ranks      # the comparison only (a few seconds faster)

    from utils.published_runs import compare, table
    print(table(compare()))

The runs are notebooks/data/published_layouts.json's, each predicted on its own GPUs (Cluster.of) with the exact
published layout (dp, tp, pp, cp, micro-batch, micro-batches from the global batch) and the recomputation, sequence
parallelism and attention kernel its software ran (the json's `families` and `as_run`: what the source states, and
what is assumed, with why). What a source leaves out (the micro-batch size, the number of virtual stages) is the
planner's best choice for that same dp, tp, pp, cp, and the table says so, with the figure the slowest of those
choices would give beside it (a row's error is read against that range). The model state is what the source's software
kept (the json's as_run precision: Megatron-LM's papers fp16 with 16-bit gradients, the ZeRO paper's 16 bytes a
parameter; Llama 3 bf16 with fp32 gradients, 18). Each run is compared in the quantity its source publishes, counted
as the source counts it:
- Narayanan et al. 2021, Table 1: hardware TFLOP/s per GPU (their equation (3) counts full recomputation's extra
  forward): the planner's tflops_per_gpu with recompute="full", unfused attention, no sequence parallelism.
- Korthikanti et al. 2022, Table 5: MFU and HFU (their equations (7) and (8): the attention counted whole, and in
  the HFU the recomputed attention as equation (8) counts it) with selective recomputation and sequence
  parallelism, unfused attention, as Megatron-LM ran them; and the speed-up of that over full recomputation without
  sequence parallelism (the table's two iteration times), which isolates the planner's recomputation physics from
  its matmul efficiency.
- Llama 3 405B, Table 4: BF16 MFU (PaLM's count, 6N + 12 L s h per token: the attention whole, where the planner's
  own MFU counts its causal half), fused attention (FlashAttention-2 assumed: the paper names no kernel, and
  FlashAttention-3's rate would put the 128K row far above its MFU), FSDP without resharding (the planner's ZeRO-1
  under a pipeline: ZeRO-2 with a reduce-scatter every micro-batch, which the planner offers for this framework,
  would put the 8K rows far below theirs), the interleaved schedule, sequence parallelism as Megatron-LM runs it.
- ZeRO, Figure 1: model-state bytes per GPU for 7.5B parameters over 64 ranks, mixed-precision Adam.
- DeepSeek-V3: the layout beside the planner's ranking, without a number (the json's why_no_number).
Beside each: the predicted memory per GPU (* where the planner refuses a layout its authors ran) and the rank of the
published (dp, tp, pp, cp): where the best variant of it stands among every layout plan() can run for the same
model, GPUs and global batch (its candidates: fused attention, any recomputation and ZeRO stage, the source's
sequence parallelism), and how many run.

Tolerances, from what the planner leaves out, sized with the sources' own numbers:
- The planner has one fitted number, MATMUL_EFFICIENCY, fitted to Narayanan et al.'s ten rows together (the
  geometric mean of predicted over published is 1: a test checks it), so their spread, not their level, is what those
  rows test. It is the same for every matrix shape, while with the same software and GPUs their utilization grows
  from 44 % (1.7B) to 52 % (1T), 18 % more: a constant spread over that range leaves about +-9 %, and their runs
  include what the planner leaves out (the optimizer step, data loading): +-10 %.
- Korthikanti et al. ran the same A100s a year later with better kernels: on the same 1T model their HFU is 57.0 %
  against Narayanan's 52 % (10 % more), on top of the growth with size that a constant efficiency misses: +-20 %.
  The speed-up of their method over full recomputation, two predictions of the same layout, divides the efficiency
  out and tests the recomputation physics alone: +-10 %.
- Llama 3 ran on H100s, whose matmul efficiency the planner takes from the A100 fit (an H100's peak is harder to
  feed), and its attention kernels' rate from FlashAttention's papers: +-15 %.
- ZeRO's Figure 1 is a formula the planner implements: exact, to the figure's printed precision (0.1 GB).
Every row must be within its tolerance (the command exits with 1 when one is not); layouts the planner refuses for
memory although they ran are in MEMORY_MISSES, with why.
"""

import argparse
import itertools
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from utils.memory import human
from utils.planner import Cluster, Layout, Model, Prediction, evaluate, model_flops_per_token, plan, stage_model_state

DATA = Path(__file__).resolve().parents[1] / "notebooks" / "data" / "published_layouts.json"

TOLERANCE = {"narayanan2021": 0.10, "korthikanti2022": 0.20, "llama3": 0.15, "speed-up": 0.10}
MEMORY_CLAIM = "fits: SP+sel. only"  # Korthikanti et al. 2022, section 6.1
MICRO_BATCHES = (1, 2, 4, 8)  # what the planner tries where a source does not state the micro-batch size
VIRTUAL_STAGES = tuple(range(1, 9))  # and where it does not state the interleaved schedule's chunks per rank
MEGATRON = ("narayanan2021", "korthikanti2022")  # sources whose software was Megatron-LM
PLAN_VIRTUAL_STAGES = (1, 2, 4, 8)  # the candidates a run's layout is ranked among

# Published layouts the planner refuses for memory although their authors ran them, and why it overestimates.
MEMORY_MISSES = {
    "Llama 3 405B, 8K GPUs": "interleaved 1F1B keeps L (1 + (p-1)/(p v)) layers' worth of activations on the first "
    "stage (Korthikanti et al.'s count, with SwiGLU's gate and narrow K/V), which with the model state is more than an "
    "H100 gives after the reserve. Meta frees each stage's input and output tensors (section 3.3.2) and may keep fewer "
    "micro-batches in flight or run closer to the GPU's 80 GB; the paper does not quantify either",
    "Llama 3 405B, 16K GPUs": "as for 8K GPUs (16 micro-batches per step: p - k of them in flight)",
}


@dataclass
class Row:
    name: str  # the published run
    family: str  # its source (a key of the json's families)
    quantity: str  # what is compared: "TFLOP/s per GPU", "MFU", "HFU", "speed-up", "model state", "-"
    published: float | None
    predicted: float | None
    tolerance: float | None  # relative; 0: exact to the published precision
    layout: Layout | None = None  # the layout predicted (the published one, with the planner's choices filled in)
    memory: float | None = None  # predicted bytes per GPU on the stage that needs the most
    fits: bool | None = None
    reason: str | None = None  # why the planner refuses the layout, when it does
    rank: int | None = None  # where the best variant of the published (dp, tp, pp, cp) ranks among runnable ones
    candidates: int | None = None  # how many runnable layouts the planner found for the same model, GPUs, batch
    choices: str = ""  # what the planner chose because the source does not say
    note: str = ""  # why there is no number
    spread: tuple | None = (
        None  # (lowest, highest, the lowest's choices) over what a source leaves open, if they differ
    )

    @property
    def error(self) -> float | None:
        if self.published is None or self.predicted is None or self.quantity == MEMORY_CLAIM:
            return None
        return self.predicted / self.published - 1

    @property
    def within(self) -> bool | None:
        if self.quantity == MEMORY_CLAIM:
            return self.predicted == self.published
        if self.error is None:
            return None
        if self.tolerance == 0:  # exact to the published figure's printed precision
            return abs(self.predicted - self.published) <= 0.05 + 1e-9
        return abs(self.error) <= self.tolerance


def load(path: Path = DATA) -> dict:
    return json.loads(Path(path).read_text())


def model_of(entry: dict) -> Model:
    return Model(
        entry["params"], entry["layers"], entry["hidden"], entry["heads"], entry["vocab"], entry["seq_len"],
        entry.get("experts", 1), entry.get("top_k", 1), entry.get("ffn_hidden"), entry.get("kv_heads"),
        entry.get("gated_mlp", False), entry.get("dropout", True),
    )  # fmt: skip


def cluster_of(entry: dict) -> Cluster:
    return Cluster.of(entry["hardware"], entry["gpus"], entry["gpus_per_node"])


def as_run(entry: dict, families: dict) -> dict:
    """How the source's software ran the layout: its family's as_run, overridden by the entry's own."""
    return {**families[entry["family"]]["as_run"], **entry.get("as_run", {})}


def chunks_even(entry: dict, v: int) -> bool:
    """Whether v virtual stages cut the model as the source's software could: Megatron-LM (Narayanan, Korthikanti)
    needs layers divisible by pp x v (--num-layers-per-virtual-pipeline-stage); Llama 3's stages hold ceil(L / pp)
    layers but the first and the last (one fewer), so v divides ceil(L / pp)."""
    layers, pp = entry["layers"], entry["pp"]
    if pp == 1:
        return v == 1
    if entry["family"] in MEGATRON:
        return layers % (pp * v) == 0
    return math.ceil(layers / pp) % v == 0


def state_of(run: dict) -> dict:
    """The model state's precision and optimizer as the source's software kept them (utils/memory.py's names)."""
    return {"precision": run.get("precision", "bf16"), "optimizer": "adam"}


def variants(entry: dict, run: dict) -> list[Layout]:
    """The published layout with every choice the source leaves open (micro-batch, virtual stages, recomputation)
    taken over the planner's candidates; the stated ones fixed. An unstated micro-batch never leaves a pipeline
    fewer micro-batches than stages: the bubble would be over half the step, a choice no one reports running."""
    dp, pp, batch = entry["dp"], entry["pp"], entry["global_batch"]
    micro = [entry["micro_batch"]] if entry["micro_batch"] else MICRO_BATCHES
    virtual = (
        [run["virtual_stages"]] if run.get("virtual_stages") else [v for v in VIRTUAL_STAGES if chunks_even(entry, v)]
    )
    recompute = [run["recompute"]] if run.get("recompute") else ("none", "selective", "full")
    fixed = dict(zero=run["zero"], sequence_parallel=run["sequence_parallel"], cp=entry.get("cp", 1),
                 ep=entry.get("ep", 1), fused_attention=run["fused_attention"], framework=run["framework"],
                 attention_kernel=run.get("attention_kernel", "fa2"))  # fmt: skip
    return [
        Layout(dp, entry["tp"], pp, b, batch // (dp * b), recompute=r, virtual_stages=v, **fixed)
        for b, v, r in itertools.product(micro, virtual, recompute)
        if batch % (dp * b) == 0 and (entry["micro_batch"] or batch // (dp * b) >= pp)
    ]


def candidates_of(entry: dict, run: dict, model: Model, cluster: Cluster) -> list[Prediction]:
    """Every variant of the published layout that fits; when none fits (the planner then disagrees with a run that
    happened), every one whose shape is sound, with the memory refusal kept as its reason."""
    predictions = [evaluate(model, cluster, layout, entry["global_batch"], **state_of(run))
                   for layout in variants(entry, run)]  # fmt: skip
    runnable = [pred for pred in predictions if pred.fits] or [pred for pred in predictions if pred.step_s]
    if not runnable:
        raise ValueError(f"{entry['name']}: the planner refuses every variant ({predictions[0].reason})")
    return runnable


def predict_published(entry: dict, run: dict, model: Model, cluster: Cluster) -> Prediction:
    """The published layout as predicted: the fastest of its candidates (candidates_of). Where the source is silent
    that is the planner's best choice, the top of the range run_rows reports."""
    return max(candidates_of(entry, run, model, cluster), key=lambda pred: pred.tokens_per_s)


def choices_made(entry: dict, run: dict, layout: Layout) -> str:
    """What the planner chose for this run because its source does not say."""
    chosen = []
    if not entry.get("micro_batch"):
        chosen.append(f"micro-batch {layout.micro_batch}")
    if not run.get("virtual_stages") and layout.pp > 1:
        chosen.append(f"{layout.virtual_stages} virtual stage{'s' * (layout.virtual_stages > 1)}")
    if not run.get("recompute"):
        chosen.append(f"recompute {layout.recompute}")
    return ", ".join(chosen)


def powers_of_two_to(n: int) -> tuple[int, ...]:
    return tuple(2**k for k in range(int(math.log2(n)) + 1) if n % 2**k == 0)


def rank_of(entry: dict, run: dict, model: Model, cluster: Cluster) -> tuple[int | None, int]:
    """Where the published (dp, tp, pp, cp) ranks among every layout the planner can run for the same model, GPUs and
    global batch: the position of its best variant among the runnable ones (None: no variant of it runs), and how
    many run. Candidates: plan()'s, with the source's sequence parallelism, its cp and ep sizes and the powers of two
    below them, and PLAN_VIRTUAL_STAGES."""
    cp, ep = entry.get("cp", 1), entry.get("ep", 1)
    ranked = plan(
        model, cluster, entry["global_batch"], MICRO_BATCHES, run["sequence_parallel"], powers_of_two_to(cp),
        powers_of_two_to(ep), PLAN_VIRTUAL_STAGES,
        {"framework": run.get("framework", "torch"), "attention_kernel": run.get("attention_kernel", "fa2")},
        **state_of(run),
    )  # fmt: skip
    runnable = [pred for pred in ranked if pred.fits]
    dims = (entry["dp"], entry["tp"], entry["pp"], cp)
    for place, pred in enumerate(runnable, 1):
        if (pred.layout.dp, pred.layout.tp, pred.layout.pp, pred.layout.cp) == dims:
            return place, len(runnable)
    return None, len(runnable)


def run_rows(entry: dict, families: dict, ranks: bool) -> list[Row]:
    """One published run: a row per quantity its source publishes."""
    run = as_run(entry, families)
    model, cluster = model_of(entry), cluster_of(entry)
    candidates = candidates_of(entry, run, model, cluster)
    pred = max(candidates, key=lambda pred: pred.tokens_per_s)
    common = dict(
        name=entry["name"], family=entry["family"], layout=pred.layout, memory=pred.memory, fits=pred.fits,
        reason=pred.reason, choices=choices_made(entry, run, pred.layout),
        note=MEMORY_MISSES.get(entry["name"], "") if not pred.fits else "",
    )  # fmt: skip
    if ranks:
        common["rank"], common["candidates"] = rank_of(entry, run, model, cluster)
    published, tolerance, batch = entry["published"], TOLERANCE[entry["family"]], entry["global_batch"]
    rows = []

    def spread(quantity):  # over the choices the source leaves open: None when they agree to 0.1 %
        slowest = min(candidates, key=quantity)
        low, high = quantity(slowest), quantity(pred)
        return (low, high, choices_made(entry, run, slowest.layout)) if high > 1.001 * low else None

    if entry["family"] == "narayanan2021":
        rows.append(Row(quantity="TFLOP/s per GPU", published=published["tflops_per_gpu"],
                        predicted=pred.tflops_per_gpu, tolerance=tolerance,
                        spread=spread(lambda p: p.tflops_per_gpu), **common))  # fmt: skip
    # MFU as both sources count it: the attention's scores counted whole, 12 L s h a token (PaLM's count, and
    # Korthikanti et al.'s equation (7)), where the planner's own MFU counts the causal half.
    whole = model_flops_per_token(model, whole_attention=True) / model_flops_per_token(model)
    mfu = pred.mfu * whole
    if "mfu_percent" in published:
        rows.append(Row(quantity="MFU", published=published["mfu_percent"] / 100, predicted=mfu,
                        tolerance=tolerance, spread=spread(lambda p: p.mfu * whole), **common))  # fmt: skip
    if "hfu_percent" in published:  # equation (8): equation (7)'s count with s/3h for s/6h (the recomputed attention)
        s, h, vocab, layers = model.seq_len, model.hidden, model.vocab, model.layers
        hfu = mfu * (1 + s / (3 * h) + vocab / (12 * h * layers)) / (1 + s / (6 * h) + vocab / (12 * h * layers))
        rows.append(Row(quantity="HFU", published=published["hfu_percent"] / 100, predicted=hfu,
                        tolerance=tolerance, **common))  # fmt: skip
    if "iteration_s_full_recompute" in published:  # Korthikanti's baseline: full recomputation, no SP
        full = evaluate(model, cluster, replace(pred.layout, recompute="full", sequence_parallel=False), batch,
                        **state_of(run))  # fmt: skip
        rows.append(Row(quantity="speed-up", published=published["iteration_s_full_recompute"] /
                        published["iteration_s"], predicted=full.step_s / pred.step_s,
                        tolerance=TOLERANCE["speed-up"], **common))  # fmt: skip

        # Section 6.1: the layout fits with sequence parallelism and selective recomputation together, with full
        # recomputation (Table 5 ran it), and with neither of the two alone.
        def fits(recompute, sequence_parallel):
            layout = replace(pred.layout, recompute=recompute, sequence_parallel=sequence_parallel)
            return evaluate(model, cluster, layout, batch, **state_of(run)).fits

        claim = fits("selective", True) and fits("full", False)
        claim = claim and not any(fits(r, sp) for r, sp in (("none", False), ("none", True), ("selective", False)))
        rows.append(Row(quantity=MEMORY_CLAIM, published=1.0, predicted=float(claim), tolerance=0.0, **common))
    return rows


def memory_rows(figures: list[dict]) -> list[Row]:
    """ZeRO's Figure 1: the planner's model state per GPU (stage_model_state, the model spread evenly: only the
    parameter count matters) for the figure's Psi, Nd and stage."""
    rows = []
    for figure in figures:
        model = Model(figure["params"], 1, 1, 1, 1, 1)  # model state depends on the parameter count alone
        layout = Layout(figure["dp"], 1, 1, 1, 1, figure["zero"])
        state = sum(stage_model_state(model, layout, figure["precision"], figure["optimizer"]).values())
        rows.append(Row(figure["name"], "zero2020", "model state GB", figure["published"]["model_state_GB"],
                        state / 1e9, 0.0, memory=state, fits=True, note=f"{figure['formula']} bytes"))  # fmt: skip
    return rows


def comparison_rows(comparisons: list[dict], ranks: bool) -> list[Row]:
    """Layouts shown without a number (DeepSeek-V3): the layout, where it ranks among the planner's, no error."""
    rows = []
    for entry in comparisons:
        batch, dp = entry["global_batch"], entry["dp"]
        layout = Layout(dp, entry["tp"], entry["pp"], 1, batch // dp, entry["zero"], ep=entry.get("ep", 1))
        row = Row(entry["name"], "comparison", "-", None, None, None, layout, note=entry["why_no_number"])
        if ranks:
            model = Model(**entry["planner_model"])
            row.rank, row.candidates = rank_of(entry, {"sequence_parallel": True}, model, cluster_of(entry))
        rows.append(row)
    return rows


def compare(ranks: bool = True, path: Path = DATA) -> list[Row]:
    """Every published figure beside the planner's, as Rows (table() prints them). ranks=False skips ranking each
    layout among the planner's candidates, the slow part (seconds against a fraction of one)."""
    data = load(path)
    rows = []
    for entry in data["layouts"] + data["more_layouts"]:
        rows += run_rows(entry, data["families"], ranks)
    return rows + memory_rows(data["memory_figures"]) + comparison_rows(data["comparisons"], ranks)


def figure(value: float | None, quantity: str) -> str:
    if value is None:
        return "-"
    if quantity in ("MFU", "HFU"):
        return f"{value:.1%}"
    if quantity == "speed-up":
        return f"{value:.3f}x"
    if quantity == MEMORY_CLAIM:
        return "yes" if value else "no"
    return f"{value:.1f}"


def software(layout: Layout) -> str:
    """The settings a Layout's str() does not show."""
    kernel = layout.attention_kernel if layout.fused_attention else "unfused"
    return f"{'SP' if layout.sequence_parallel else 'no SP'}, {kernel}"


def table(rows: list[Row]) -> str:
    """The comparison as text: one line per compared quantity (a run's memory, rank and layout on its first line),
    then what the planner chose where a source is silent and the refusals, and how each source's
    software ran (stated or assumed, from the json)."""
    header = (
        f"{'published run':34s} {'quantity':>17s} {'published':>9s} {'predicted':>9s} {'error':>7s} {'tol.':>5s} "
        f"{'memory':>8s} {'rank':>11s}  layout (the planner's where the source is silent)"
    )
    lines, notes, previous = [header], [], None
    for row in rows:
        error = "-" if row.error is None else f"{row.error:+.1%}"
        tolerance = "-" if row.tolerance is None else ("exact" if row.tolerance == 0 else f"{row.tolerance:.0%}")
        mark = "" if row.within in (None, True) else " !"
        cells = f"{row.name[:34]:34s} {row.quantity:>17s} {figure(row.published, row.quantity):>9s} "
        cells += f"{figure(row.predicted, row.quantity):>9s} {error + mark:>7s} {tolerance:>5s}"
        if row.name != previous:
            memory = "-" if row.memory is None else human(row.memory) + ("" if row.fits in (None, True) else "*")
            rank = "-" if row.candidates is None else f"{row.rank or 'none'} of {row.candidates}"
            layout = "" if row.layout is None else f"{row.layout} ({software(row.layout)})"
            if row.family == "comparison" and row.layout is not None:
                lay = row.layout
                layout = f"dp={lay.dp} tp={lay.tp} pp={lay.pp} ep={lay.ep} zero={lay.zero} (published)"
            cells += f" {memory:>8s} {rank:>11s}  {layout}"
        lines.append(cells.rstrip())
        previous = row.name
        if row.choices:
            notes.append(f"{row.name}: the planner's where the source is silent: {row.choices}")
        if row.spread:
            low, high = (figure(value, row.quantity) for value in row.spread[:2])
            notes.append(f"{row.name}, {row.quantity}: {high} with the planner's choices, {low} with the slowest "
                         f"the source leaves open ({row.spread[2]})")  # fmt: skip
        if row.note and row.family not in ("zero2020",):
            notes.append(f"{row.name}, {row.quantity}: {row.note}")
        if row.fits is False:
            notes.append(f"{row.name}: * the planner refuses the layout that ran: {row.reason}")
    unique = list(dict.fromkeys(notes))
    return "\n".join(lines + ([""] + unique if unique else []))


def how_they_ran(path: Path = DATA) -> str:
    """Per source: what its figure counts and how its software ran, each setting stated or assumed (and why)."""
    lines = []
    for key, family in load(path)["families"].items():
        settings = []
        for name, value in family["as_run"].items():
            why = family["stated"].get(name) or family["assumed"].get(name)
            kind = "stated" if name in family["stated"] else "assumed"
            shown = "per run" if value is None else value
            settings.append(f"{name}={shown} ({kind}: {why})" if why else f"{name}={shown}")
        lines.append(f"{key}: compared: {family['compared']}; FLOPs: {family['flops']}")
        lines.append("  as run: " + "; ".join(settings))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m utils.published_runs",
        description="Published training runs beside the planner's prediction for the same layout, with the error.",
        epilog="Exit status 1 when a row misses its tolerance.",
    )
    parser.add_argument("--no-ranks", action="store_true", help="skip ranking each layout among the planner's")
    parser.add_argument("--data", type=Path, default=DATA, help="the published layouts (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    rows = compare(not args.no_ranks, args.data)
    print(table(rows))
    print("\n" + how_they_ran(args.data))
    outside = [row for row in rows if row.within is False]
    for row in outside:
        print(f"outside tolerance: {row.name}, {row.quantity}: {row.error:+.1%}", file=sys.stderr)
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
