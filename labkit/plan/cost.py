"""The planner's cost model: a training step's predicted time on a device, and a plan's fidelity.

Time of one optimizer step on one device, the sum of five parts (nothing is assumed to overlap, so the
model is conservative for plans that communicate or offload):

1. compute: FLOPs / (peak x MFU), a roofline per micro-batch: each micro-batch takes the longer of its FLOPs
   at MFU x peak and its weight traffic at the memory bandwidth (the weights are read once forward and once
   backward per micro-batch, so small micro-batches become memory-bound). FLOPs, with N the parameters that
   enter a matmul (labkit.estimate.spec.ModelSpec.matmul_params) and T the tokens of the step:
     forward 2 N T + attention 4 L S d T (QK^T and AV, PaLM's count: Chowdhery et al. 2022, appendix B);
     backward 2x forward in full training (dX and dW). A frozen base needs dX only (2 N T) plus the adapters'
     dX and dW (4 N_adapters T); LISA: dX everywhere + dW of the active layers and the head;
     recompute: full and sqrt checkpointing run the blocks' forward once more (Chen et al. 2016); selective
     (labkit's "matmuls" policy) keeps every matmul output and recomputes only pointwise ops, which are
     memory-bound: 2 x (the activation bytes it drops) / memory bandwidth (each recomputed op reads an input
     and writes an output about that size).
   The peak is the tensor-core bf16/fp16 peak for every dtype but pure fp32 (autocast runs matmuls in 16 bits).
   MFU = 0.40: Llama 3 reports 38-43 % BF16 MFU on H100s (Dubey et al. 2024, "The Llama 3 Herd of Models",
   table 4); PaLM 46.2 % (Chowdhery et al. 2022). QLoRA's NF4 weights are dequantized on the fly each time they
   are used (read 0.5 B, write and read 2 B per weight).
2. host: bytes over the host link. Optimizer offload (labkit.optim.OffloadAdamW) moves the gradients down and
   the updated parameters up each step and runs AdamW on the host at host memory bandwidth (HOST_MEM_BW, or the
   device's own when it is slower: on the cpu preset the "host" is the same memory); activation offload
   moves the saved activations down in forward and up in backward; ZeRO-Offload moves a rank's shards.
3. comm: bytes each rank sends (labkit.distributed.comms.wire_bytes, ring algorithms) over the interconnect:
   data parallel all-reduces the gradients, 2 psi (N-1)/N; ZeRO-1/2 reduce-scatter + all-gather, the same;
   ZeRO-3 gathers the parameters in forward and backward and reduce-scatters the gradients, 3 psi (N-1)/N
   (Rajbhandari et al. 2020, section 7); tensor and pipeline parallel as labkit.estimate.layout_terms.
   layout_wire_bytes. A pipeline idles (p - 1) / m of its compute (Narayanan et al. 2021, section 2.2).
4. optimizer: the step is memory-bound: bytes it reads and writes / memory bandwidth. Per trained element:
   the weight read and written and the gradient read (3 d), plus each state read and written (2 d per state
   for AdamW's m and v and Lion's momentum). An 8-bit state (labkit.optim, unfused) is dequantized (read 1 B,
   write 4 B), updated in fp32 (read 4, write 4) and requantized (read 4, write 1): 18 B per state element.
   Adafactor (labkit.optim.Adafactor) reads and writes its state as stored (a matrix's row and
   column averages, a vector's full second moment: labkit.optim.adafactor.state_bytes_for),
   reads the gradient once more (the averages come before the update) and writes and reads
   back its fp32 update (update clipping needs its RMS first): 2 x its state bytes + (d + 8)
   per element. GaLore projects each matrix's gradient to rank r and back (2 x 2 m n r FLOPs) and
   every update_proj_gap = 200 steps (GaLore's default) takes an SVD of it, about 4 k^2 l + 22 k^3 FLOPs for a
   k x l matrix, k <= l (Golub & Van Loan, Matrix Computations, 4th ed., section 8.6, R-SVD), at the fp32 peak
   x MFU (an SVD is in fact less efficient than a GEMM: this part is a lower bound), amortised over the gap.

Fidelity (higher is closer to plain full-precision training), compared as a tuple, in this order:
precision first (fp32 master weights, fp32 or mixed-*, 1 > pure bf16/fp16 0), then method (full training 4 >
LISA 3 > LoRA on a 16-bit base 2 > LoRA on an int8 base 1 > QLoRA / 4-bit base 0), then optimizer (AdamW 1 >
every approximation or other algorithm 0: 8-bit states, low-rank projection, factored moments, sign updates).
Precision comes first because without fp32 master weights the trained weights themselves are 16-bit, and
round-to-nearest drops every update smaller than half the spacing of the weight's format: below
LOST_UPDATE[dtype] x |w| (2**-9 in bf16, whose significand has 8 bits, 2**-12 in fp16) an update is always lost,
so at a fine-tuning learning rate most small weights never move (stale weights), unless the optimizer rounds
stochastically or keeps a compensation buffer (Kahan summation), which labkit's optimizers do not (Zamirai et al.
2020, "Revisiting BFloat16 Training", arXiv 2010.06192). A full fine-tuning whose updates are lost is not
closer to full training than LoRA or QLoRA whose trained adapters keep fp32 weights.
Checkpointing, micro-batching, offload, step-in-backward and ZeRO change no arithmetic: they have no rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.distributed.comms import wire_bytes

from .devices import Device

MFU = 0.40  # model FLOPs utilisation of dense matmuls (sources above)
GALORE_GAP = 200  # GaLore's update_proj_gap (Zhao et al. 2024; labkit.optim.galore.GALORE_DEFAULTS)
HOST_MEM_BW = 204.8e9  # host DRAM for an offloaded optimizer step: 8 channels DDR4-3200 x 25.6 GB/s (JEDEC JESD79-4)
STATE_BYTES_8BIT = 18  # per 8-bit state element and step: 1+4 dequantize, 4+4 update, 4+1 requantize
# an update below LOST_UPDATE x |w| always rounds away: half the spacing of the format at |w|, at least
# 2**-(stored significand bits + 2) x |w| (torch.finfo(dtype).eps / 4: bf16 eps 2**-7, fp16 2**-10)
LOST_UPDATE = {"bf16": 2.0**-9, "fp16": 2.0**-12}
METHODS = {"full": 4, "lisa": 3, "lora": 2, "lora-int8": 1, "qlora": 0}
METHOD_TITLES = {"full": "full training", "lisa": "LISA", "lora": "LoRA", "lora-int8": "LoRA on an int8 base",
                 "qlora": "QLoRA (4-bit base)"}


def method_of(recipe) -> str:
    """"full", "lisa", "lora", "lora-int8" or "qlora" (any 4-bit base: nf4, int4, int4-awq)."""
    if recipe.lisa_layers:
        return "lisa"
    if recipe.lora_rank:
        return {"none": "lora", "int8": "lora-int8"}.get(recipe.quant, "qlora")
    return "full"


@dataclass(frozen=True, order=True)
class Fidelity:
    """(precision, method, optimizer) levels, compared in that order (the module docstring)."""

    precision: int
    method: int
    optimizer: int

    @classmethod
    def of(cls, recipe) -> "Fidelity":
        """Precision counts the trained parameters only (recipe.dtype): a frozen base in 16 bits (base_dtype)
        takes no update, so it loses none."""
        return cls(precision=int(recipe.dtype in ("fp32", "mixed-bf16", "mixed-fp16")),
                   method=METHODS[method_of(recipe)], optimizer=int(recipe.optimizer in ("adamw", "adam")))

    def describe(self) -> str:
        method = next(METHOD_TITLES[k] for k, v in METHODS.items() if v == self.method)
        return (f"{method}, {'fp32 master weights' if self.precision else '16-bit weights, no fp32 master copy'}, "
                f"{'AdamW' if self.optimizer else 'an approximate or other optimizer'}")


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step on one device, by part (the module docstring)."""

    compute: float
    recompute: float
    host: float
    comm: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.host + self.comm + self.optimizer

    def parts(self) -> dict[str, float]:
        return {"compute": self.compute, "recompute": self.recompute, "host": self.host, "comm": self.comm,
                "optimizer": self.optimizer}


def _peft(recipe, spec):
    from labkit.estimate import peft_terms

    return peft_terms.of_recipe(spec, recipe)


def flops(recipe, spec, tokens: int) -> dict[str, float]:
    """Forward, backward and recompute FLOPs of `tokens` tokens (the module docstring, part 1)."""
    from labkit.estimate import peft_terms

    n, L, s = spec.matmul_params, spec.n_layer, recipe.seq
    attn = 4 * L * s * spec.attn_width * tokens  # QK^T and AV, forward
    blocks = 2 * L * spec.layer_matmul_params * tokens + attn  # the blocks' forward (what recompute repeats)
    fwd = 2 * n * tokens + attn
    method = method_of(recipe)
    if method == "full":
        bwd = 2 * fwd
    else:
        peft = _peft(recipe, spec)
        if method == "lisa":
            head = n - L * spec.layer_matmul_params  # matmul weights outside the blocks (the output head)
            bwd = fwd + attn + 2 * (recipe.lisa_layers * spec.layer_matmul_params + head) * tokens
        else:
            adapters = peft_terms.adapter_elements(peft)
            fwd += 2 * adapters * tokens
            blocks += 2 * adapters * tokens
            bwd = 2 * n * tokens + 2 * attn + 4 * adapters * tokens
    recompute = blocks if recipe.checkpoint in ("full", "sqrt") else 0
    return {"forward": float(fwd), "backward": float(bwd), "recompute": float(recompute)}


def trained_params(recipe, spec) -> int:
    """Parameters that get gradients and optimizer state."""
    if method_of(recipe) == "full":
        return spec.n_params
    from labkit.estimate import peft_terms

    return peft_terms.trainable_spec(spec, _peft(recipe, spec)).n_params


def weight_bytes(recipe) -> int:
    """Bytes per parameter element (and gradient and state element) as the recipe stores them."""
    return 4 if recipe.dtype in ("fp32", "mixed-bf16", "mixed-fp16") else 2


def _weight_traffic(recipe, spec) -> float:
    """Bytes of weights one micro-batch's forward and backward read (twice each matmul weight; a dequantized
    4-bit weight also reads its 0.5 B code and writes its 2 B copy each time)."""
    e = 4 if recipe.dtype == "fp32" else 2  # what the matmul reads
    reads = 2 + (1 if recipe.checkpoint in ("full", "sqrt") else 0)
    q = 0
    if recipe.lora_rank and recipe.quant != "none":
        from labkit.estimate import peft_terms

        q = peft_terms.quantized_weights(spec, _peft(recipe, spec))
    per_q = (0.5 if recipe.quant != "int8" else 1.0) + 2 * e
    return reads * ((spec.matmul_params - q) * e + q * per_q)


def optimizer_bytes_and_flops(recipe, spec) -> tuple[float, float]:
    """(bytes read and written, FLOPs) of one optimizer step over every trained element (part 4)."""
    d = weight_bytes(recipe)
    n = trained_params(recipe, spec)
    opt = recipe.optimizer
    base = 3 * d
    state = {"adamw": 4 * d, "adam": 4 * d, "adamw8bit": 2 * STATE_BYTES_8BIT, "adam8bit": 2 * STATE_BYTES_8BIT,
             "lion": 2 * d, "sgd": 0, "sgd-momentum": 2 * d}
    if opt == "adafactor":
        return float(n * base + adafactor_extra_bytes(recipe, spec)), 0.0
    if not opt.startswith("galore"):
        return float(n * (base + state[opt])), 0.0
    eight = opt == "galore8bit"
    r = recipe.rank
    nbytes, fl, covered = 0.0, 0.0, 0
    for shape in spec.galore_shapes:
        k, l = sorted(shape)
        rr = min(r, k)
        low = rr * l  # the projected gradient's elements (state per moment)
        nbytes += k * l * base + low * (2 * STATE_BYTES_8BIT if eight else 4 * d)
        fl += 4 * k * l * rr + (4 * k * k * l + 22 * k ** 3) / GALORE_GAP
        covered += k * l
    rest = max(n - covered, 0)  # embeddings, norms, head: plain AdamW (8-bit for galore8bit)
    nbytes += rest * (base + (2 * STATE_BYTES_8BIT if eight else 4 * d))
    return nbytes, fl


def adafactor_extra_bytes(recipe, spec) -> int:
    """labkit.optim.Adafactor's step traffic beyond the weight and gradient (part 4): its factored
    state read and written, as stored (not a full state's 2 d per element), the gradient's second
    read and the fp32 update written and read back, d + 8 per trained element."""
    from labkit.estimate import optim_terms, peft_terms

    d = weight_bytes(recipe)
    trained = (spec if method_of(recipe) == "full"
               else peft_terms.trainable_spec(spec, _peft(recipe, spec)))
    return 2 * optim_terms.state_bytes(trained, d, "adafactor") + trained.n_params * (d + 8)


def host_link_bytes(recipe, spec, act_bytes: float = 0.0) -> float:
    """Bytes one device sends and receives over its host link per step (part 2): an offloaded optimizer's gradients
    down and parameters up, offloaded activations down in forward and up in backward, ZeRO-Offload's shards."""
    n, d = trained_params(recipe, spec), weight_bytes(recipe)
    m = recipe.rank_batch // recipe.micro
    b = 2 * n * d if recipe.optimizer_offload else 0.0
    b += m * 2 * act_bytes if recipe.offload_activations else 0.0
    b += 2 * n * d / recipe.dp if recipe.dp > 1 and recipe.zero_offload else 0.0
    return float(b)


def step_time(recipe, device: Device, spec, act_bytes: float = 0.0, selective_bytes: float = 0.0) -> StepTime:
    """Predicted seconds of one step of `recipe` on each of its devices (the module docstring).

    act_bytes: saved activations of one micro-batch (what activation offload moves), from the estimate;
    selective_bytes: activation bytes of one micro-batch that selective checkpointing drops and recomputes."""
    world = recipe.dp * recipe.tp * recipe.pp
    tokens = recipe.batch * recipe.seq  # the whole step, all devices
    m = recipe.rank_batch // recipe.micro  # micro-batches per rank
    share = recipe.tp * recipe.pp  # devices one replica's compute is split over
    peak = (device.fp32_flops if recipe.dtype == "fp32" else device.tensor_flops) * MFU
    f = flops(recipe, spec, tokens // recipe.dp)  # one data-parallel replica
    per_mb = (f["forward"] + f["backward"]) / m / share / peak
    mem_mb = _weight_traffic(recipe, spec) / share / device.hbm_bw
    bubble = (m + recipe.pp - 1) / m if recipe.pp > 1 else 1.0
    compute = m * max(per_mb, mem_mb) * bubble
    recompute = f["recompute"] / share / peak * bubble
    if recipe.checkpoint == "selective":
        recompute += m * 2 * selective_bytes / device.hbm_bw
    d = weight_bytes(recipe)
    n_train = trained_params(recipe, spec)
    host = host_link_bytes(recipe, spec, act_bytes) / device.host_bw  # the host step's own time is added below
    opt_bytes, opt_flops = optimizer_bytes_and_flops(recipe, spec)
    optimizer = opt_bytes / share / device.hbm_bw + opt_flops / share / peak
    if recipe.optimizer_offload:
        host += opt_bytes / min(HOST_MEM_BW, device.hbm_bw)
        optimizer = 0.0
    comm = 0.0
    if recipe.dp > 1:
        psi = n_train * d  # gradient bytes
        if recipe.zero == 3:
            comm += 2 * wire_bytes("all_gather", psi, recipe.dp) + wire_bytes("reduce_scatter", psi, recipe.dp)
        else:
            comm += wire_bytes("all_reduce", psi, recipe.dp)
        if recipe.zero:
            optimizer /= recipe.dp
        if recipe.zero_offload:
            host += opt_bytes / recipe.dp / min(HOST_MEM_BW, device.hbm_bw)
            optimizer = 0.0
    if recipe.tp > 1 or recipe.pp > 1:
        from labkit.estimate.layout_terms import layout_wire_bytes

        comm += sum(v for k, v in layout_wire_bytes(recipe).items() if "per layer" not in k)
    comm = comm / device.link_bw if world > 1 else 0.0
    return StepTime(compute, recompute, host, comm, optimizer)
