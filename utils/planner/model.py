"""What is trained and how it is laid out: the transformer's sizes (Model) and one way to run it on the GPUs
(Layout: the sizes of every dimension, the micro-batch, the ZeRO stage, recomputation and the software's choices)."""

from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")
# Whose sequence parallelism and selective recomputation (utils.planner.memory.activation_bytes_per_layer), and what
# its pipeline allows (utils.planner.search.check_layout): torch's PipelineStage defers FSDP's reduce-scatter to the
# last micro-batch, so ZeRO-2/3 under it hold what ZeRO-1 holds; Megatron-LM's distributed optimizer is ZeRO-1 and
# its interleaved schedule needs m a multiple of pp; "llama3" is Meta's stack as Llama 3's report describes it
# (section 3.3.2): Megatron-LM's sequence parallelism and recomputation, gradients sharded under the pipeline (one
# reduce-scatter a micro-batch), and an interleaved schedule that takes any number of micro-batches.
FRAMEWORKS = ("torch", "megatron", "llama3")
# The fused attention kernel (utils.planner.hardware.ATTENTION_PEAK_FRACTION: the share of peak each one reaches).
ATTENTION_KERNELS = ("fa2", "fa3", "cudnn")
# What hides the MoE all-to-alls (utils.planner.timing.all_to_all_seconds): nothing, or another micro-batch's compute.
EP_OVERLAP = ("none", "compute")


@dataclass(frozen=True)
class Model:
    params: float  # parameters in the whole model
    layers: int  # transformer blocks
    hidden: int  # width h
    heads: int  # attention heads a
    vocab: int  # vocabulary size v
    seq_len: int  # tokens per sequence s
    experts: int = 1  # experts per MoE layer (1: a dense model; with more, every layer's MLP is a MoE layer)
    top_k: int = 1  # experts each token is routed to
    ffn_hidden: int | None = None  # an expert's (or the MLP's) hidden width; None: 4 x hidden
    kv_heads: int | None = None  # grouped-query attention's key/value heads; None: as many as heads
    gated_mlp: bool = False  # a gated MLP (SwiGLU: gate, up and down matrices) instead of up and down
    dropout: bool = True  # dropout after the attention and the MLP, as GPT's (Llama has none: no 1-byte masks kept)
    tied_embeddings: bool = False  # the head reuses the embedding's V x h matrix (one copy per stage that uses it)

    @property
    def ffn_ratio(self) -> float:
        """The MLP's (or an expert's) hidden width against the model's: 4 unless ffn_hidden says otherwise."""
        return (self.ffn_hidden or 4 * self.hidden) / self.hidden

    @property
    def kv_fraction(self) -> float:
        """How wide K and V are against Q: kv_heads / heads (1 without grouped-query attention)."""
        return (self.kv_heads or self.heads) / self.heads

    @property
    def expert_params(self) -> float:
        """Parameters of the experts, all layers together: up and down projections of ffn_hidden x hidden each (0 for
        a dense model, whose MLP is counted with the rest). The rest of params is dense: every token uses it."""
        if self.experts == 1:
            return 0.0
        matrices = 3 if self.gated_mlp else 2
        return self.layers * self.experts * matrices * self.hidden * (self.ffn_hidden or 4 * self.hidden)

    @property
    def active_params(self) -> float:
        """The parameters one token goes through: the dense ones and top_k of each layer's experts."""
        return self.params - self.expert_params * (1 - self.top_k / self.experts)

    @property
    def embedding_params(self) -> float:
        """The token embedding's (and, on the last stage, the head's) parameters: V x h."""
        return self.vocab * self.hidden

    @property
    def layer_params(self) -> float:
        """One block's parameters (experts included): what the embedding and the head (one matrix when tied) leave
        of N, shared evenly."""
        matrices = 1 if self.tied_embeddings else 2
        return max(0.0, self.params - matrices * self.embedding_params) / self.layers

    @property
    def params_from_shapes(self) -> float:
        """The parameters the sizes imply, weight matrices only: per layer Q and O (h x h each), K and V (kv_fraction
        of that), the MLP's or every expert's matrices (ffn_hidden x h each, 3 gated), and the embedding and the head
        (V x h each, one when tied). Norms and biases are a fraction of a percent; an architecture the planner does not
        model (DeepSeek's latent attention) differs by its own share."""
        h, ffn = self.hidden, self.ffn_hidden or 4 * self.hidden
        attention = (2 + 2 * self.kv_fraction) * h * h
        mlp = (3 if self.gated_mlp else 2) * h * ffn * self.experts
        return self.layers * (attention + mlp) + (1 if self.tied_embeddings else 2) * self.embedding_params


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    micro_batch: int  # sequences per micro-batch (b)
    microbatches: int  # micro-batches per step per data-parallel replica (m)
    zero: int = 1  # ZeRO stage 0-3 over the dp group
    recompute: str = "selective"  # none, selective or full activation recomputation
    sequence_parallel: bool = True  # Megatron sequence parallelism inside the TP group (no effect at tp=1)
    cp: int = 1  # context parallelism: ranks that split each sequence
    ep: int = 1  # expert parallelism: ranks that split each MoE layer's experts, inside dp x cp
    virtual_stages: int = 1  # interleaved 1F1B: model chunks per pipeline rank (1: plain 1F1B)
    fused_attention: bool = True  # a fused attention kernel (no stored scores); False: the s x s scores are kept
    framework: str = "torch"  # whose sequence parallelism, recomputation and pipeline rules: FRAMEWORKS
    ep_overlap: str = "none"  # what hides the MoE all-to-alls: none, or another micro-batch's compute (DualPipe)
    attention_kernel: str = "fa2"  # which fused kernel: FlashAttention-2 (fa2) or -3 (fa3, Hopper GPUs only)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self):
        extra = "".join(f" {name}={size}" for name, size in (("cp", self.cp), ("ep", self.ep)) if size > 1)
        extra += f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp}{extra} mb={self.micro_batch} m={self.microbatches} "
            f"zero={self.zero} recompute={self.recompute}"
        )
