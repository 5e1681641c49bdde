"""The command line: python -m utils.planner --help. configure() turns the options into what plan() takes, refusing
bad input with one line that names the option and the fix."""

import argparse

from utils.memory import OPTIMIZER_STATE, PRECISIONS, human
from utils.planner.hardware import HARDWARE, Cluster
from utils.planner.model import ATTENTION_KERNELS, EP_OVERLAP, FRAMEWORKS, Model
from utils.planner.search import plan, rejection_summary, table, what_would_run
from utils.planner.timing import bubble_by_microbatches


def parse_size(text: str) -> float:
    """'80GB', '80e9' or '141 GB' -> bytes (decimal units, as utils/memory.py prints them)."""
    units = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}
    text = text.strip().upper()
    for unit, size in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * size
    return float(text)


def parser() -> argparse.ArgumentParser:
    presets = "; ".join(
        f"{key}: {hw['name']}, {hw['peak_flops'] / 1e12:.0f} TFLOP/s bf16, {hw['intra_bandwidth'] / 1e9:.0f} GB/s "
        f"NVLink and {hw['inter_bandwidth'] / 1e9:.0f} GB/s NIC per GPU each way"
        for key, hw in HARDWARE.items()
    )
    parser = argparse.ArgumentParser(
        prog="python -m utils.planner",
        description="Rank every (dp, tp, pp, v, cp, ep, micro-batch, ZeRO, recompute) layout by predicted tokens/s.",
        epilog=f"GPU presets (--gpu): {presets}. The other --gpu-* options override the preset. The MFU columns count "
        "the attention's causal half (causal) and the whole s x s matrix (whole: Megatron-LM's papers, PaLM, Llama 3, "
        "torchtitan). Exit status 1 when no layout runs.",
    )
    add = parser.add_argument
    add("--params", type=float, required=True, help="parameters in the model, e.g. 70e9")
    add("--layers", type=int, required=True, help="transformer blocks")
    add("--hidden", type=int, required=True, help="model width h")
    add("--heads", type=int, required=True, help="attention heads")
    add("--kv-heads", type=int, help="key/value heads of grouped-query attention (default: --heads)")
    add("--vocab", type=int, required=True, help="vocabulary size")
    add("--seq-len", type=int, required=True, help="tokens per sequence")
    add("--ffn-hidden", type=int, help="the MLP's (or an expert's) hidden width (default 4 x --hidden)")
    add("--gated-mlp", action="store_true", help="a gated MLP (SwiGLU: gate, up and down matrices), as Llama's")
    add("--no-dropout", action="store_true", help="a model without dropout (Llama): no dropout masks kept")
    add("--tied-embeddings", action="store_true", help="the head reuses the embedding matrix")
    add("--experts", type=int, default=1, help="experts per MoE layer (default 1: a dense model)")
    add("--top-k", type=int, default=1, help="experts each token goes through (MoE)")
    add("--global-batch", type=int, required=True, help="sequences per optimizer step, all GPUs together")
    add("--gpus", type=int, required=True, help="GPUs in the job")
    add("--gpu", choices=sorted(HARDWARE), default="H100", help="the GPU's preset (default H100)")
    add("--gpus-per-node", type=int, default=8, help="default: 8")
    add("--gpu-memory", help="memory per GPU, e.g. 80GB (default: the preset's)")
    add("--peak-tflops", type=float, help="dense bf16 peak per GPU (default: the preset's)")
    add("--intra-gbps", type=float, help="GB/s per GPU in a node, each way (default: the preset's NVLink)")
    add("--inter-gbps", type=float, help="GB/s per GPU across nodes, each way (default: the preset's NIC)")
    add("--precision", choices=sorted(PRECISIONS), default="bf16",
        help="model state as utils/memory.py counts it (default bf16: fp32 gradients; mixed: the ZeRO paper's "
        "fp16)")  # fmt: skip
    add("--optimizer", choices=sorted(OPTIMIZER_STATE), default="adam")
    add("--framework", choices=FRAMEWORKS, default="torch",
        help="whose sequence parallelism, selective recomputation and pipeline rules: torch's (default: DTensor, its "
        "checkpoint policy, PipelineStage, which keeps ZeRO-2/3 from sharding gradients under a pipeline), "
        "Megatron-LM's (ZeRO-1 at most under a pipeline; interleaving needs m a multiple of pp) or llama3, Meta's "
        "(Megatron-LM's activations; ZeRO-2/3 under a pipeline reduce-scatter every micro-batch; any m)")  # fmt: skip
    add("--attention-kernel", choices=ATTENTION_KERNELS, default="fa2",
        help="the fused attention kernel: fa2, FlashAttention-2 (default; on an H100 370 TFLOP/s forward, 322 "
        "backward), fa3, FlashAttention-3 (648 and 561, Hopper only) or cudnn, cuDNN's (595 and 516, Hopper), as "
        "Shah et al. 2024 (arXiv:2407.08608) measured them at head dimension 128")  # fmt: skip
    add(
        "--bubble",
        action="store_true",
        help="print the 1F1B bubble of the first layout's pipeline against m = p, 2p, 4p... micro-batches",
    )
    add("--ep-overlap", choices=EP_OVERLAP, default="none",
        help="what hides the MoE all-to-alls: none (default) or another micro-batch's compute (as DualPipe "
        "does)")  # fmt: skip
    add("--micro-batches", default="1,2,4,8", help="micro-batch sizes to try, comma-separated")
    add("--cp", default="1", help="context-parallel sizes to try, comma-separated, e.g. 1,2,4 (default 1)")
    add("--ep", default="1", help="expert-parallel sizes to try, comma-separated, e.g. 1,2,4,8 (default 1)")
    add("--virtual-stages", default="1,2,4", help="interleaved chunks per pipeline rank to try (default 1,2,4)")
    add("--unfused-attention", action="store_true", help="attention that stores its s x s scores (no fused kernel)")
    add("--no-sequence-parallel", action="store_true", help="tensor parallelism without sequence parallelism")
    add("--top", type=int, default=10, help="how many runnable layouts to print")
    add("--all", action="store_true", help="print every layout, the refused ones with their reason")
    return parser


def configure(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """(model, cluster, plan's options, the model state's precision and optimizer) from the parsed options."""
    try:
        micro_batches, cps, eps, vs = (
            tuple(int(n) for n in text.split(","))
            for text in (args.micro_batches, args.cp, args.ep, args.virtual_stages)
        )
        memory = parse_size(args.gpu_memory) if args.gpu_memory else HARDWARE[args.gpu]["memory"]
    except ValueError:
        parser.error(
            "--micro-batches, --cp, --ep and --virtual-stages take integers like 1,2,4 and --gpu-memory a size like "
            "80GB"
        )
    numbers = [args.params, args.layers, args.hidden, args.heads, args.vocab, args.seq_len, args.global_batch]
    sizes = [args.gpus, args.gpus_per_node, memory, args.top, args.experts, args.top_k, *micro_batches, *cps, *eps]
    sizes += [args.kv_heads or 1, args.ffn_hidden or 1]
    if min(numbers + sizes + list(vs)) < 1:
        parser.error(
            "model sizes, --global-batch, --gpus, --gpus-per-node, --gpu-memory, --top, --experts, --top-k, "
            "--micro-batches, --cp, --ep and --virtual-stages must be positive"
        )
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is more than --experts {args.experts}: route each token to fewer experts")
    if args.kv_heads and args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}: each K/V head serves a group")
    model = Model(
        args.params, args.layers, args.hidden, args.heads, args.vocab, args.seq_len, args.experts, args.top_k,
        args.ffn_hidden, args.kv_heads, args.gated_mlp, not args.no_dropout, args.tied_embeddings,
    )  # fmt: skip
    if model.expert_params >= model.params:
        matrices = 3 if args.gated_mlp else 2
        parser.error(
            f"{args.experts} experts of {matrices} x {args.hidden} x {args.ffn_hidden or 4 * args.hidden} parameters "
            f"in {args.layers} layers are {model.expert_params:.3g}, not less than --params {args.params:.3g}"
        )
    implied = model.params_from_shapes
    if not implied / 2 <= model.params <= 2 * implied:  # a typo in one size, not an architecture the sizes miss
        parser.error(
            f"--params {args.params:.3g} is not what {args.layers} layers of width {args.hidden} (--heads, "
            f"--kv-heads, --ffn-hidden, --gated-mlp, --experts, --vocab) hold, {implied:.3g}: fix the one that is wrong"
        )
    overrides = {"memory": memory}
    for option, key, scale in (("peak_tflops", "peak_flops", 1e12), ("intra_gbps", "intra_bandwidth", 1e9),
                               ("inter_gbps", "inter_bandwidth", 1e9)):  # fmt: skip
        if getattr(args, option) is not None:
            if getattr(args, option) <= 0:
                parser.error(f"--{option.replace('_', '-')} must be positive")
            overrides[key] = getattr(args, option) * scale
    cluster = Cluster.of(args.gpu, args.gpus, args.gpus_per_node, **overrides)
    state = {"precision": args.precision, "optimizer": args.optimizer}
    # Every layout gets the software's choices, and so does every alternative what_would_run tries.
    software = dict(framework=args.framework, ep_overlap=args.ep_overlap, fused_attention=not args.unfused_attention,
                    attention_kernel=args.attention_kernel)  # fmt: skip
    options = dict(micro_batches=micro_batches, sequence_parallel=not args.no_sequence_parallel, cps=cps, eps=eps,
                   virtual_stages=vs, software=software)  # fmt: skip
    return model, cluster, options, state


def bubble_lines(p: int, v: int) -> str:
    """The bubble against the micro-batches a step, and whose rule limits them."""
    cells = ", ".join(f"m={m}: {bubble:.1%}" for m, bubble in bubble_by_microbatches(p, v))
    return (
        f"1F1B bubble at pp={p}{f' v={v}' if v > 1 else ''} against micro-batches a step: {cells}. Megatron-LM "
        "needs m >= p (a multiple of p interleaved), torch's interleaved schedule a multiple of m // p; Llama 3 lets "
        "m be any number (section 3.3.2): a smaller bubble costs a larger batch or a smaller micro-batch"
    )


def main(argv=None) -> int:
    argument_parser = parser()
    args = argument_parser.parse_args(argv)
    model, cluster, options, state = configure(args, argument_parser)
    predictions = plan(model, cluster, args.global_batch, **options, **state)
    runnable = [pred for pred in predictions if pred.fits]
    print(
        f"{args.params:.3g} parameters, {args.gpus} x {cluster.name} ({args.gpus_per_node} per node, "
        f"{human(cluster.usable_memory)} usable of {human(cluster.memory)}), global batch {args.global_batch} x "
        f"{args.seq_len} tokens, {args.precision} {args.optimizer}, framework {args.framework}, attention "
        f"{'unfused' if args.unfused_attention else args.attention_kernel}: {len(runnable)} of {len(predictions)} "
        "layouts run"
    )
    print(table(predictions if args.all else runnable[: args.top]))
    print(f"refused ({len(predictions) - len(runnable)}):\n{rejection_summary(predictions)}")
    if args.bubble and runnable and runnable[0].layout.pp > 1:
        print(bubble_lines(runnable[0].layout.pp, runnable[0].layout.virtual_stages))
    if not runnable:
        print("no layout runs. What would:\n" + what_would_run(model, cluster, args.global_batch, predictions,
                                                               **options, **state))  # fmt: skip
        return 1
    return 0
