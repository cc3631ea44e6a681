"""Trade compute for memory: checkpointing (full, in segments, selective), activation offload, lean activations."""

from .checkpoint import ReentrantCheckpoint, RegionState, checkpoint, checkpoint_reentrant
from .selective import POLICIES as SELECTIVE_POLICIES, SelectivePolicy, selective_checkpoint, selective_contexts, torch_policy
from .segments import (BLOCK_PATHS, POLICIES, best_segments, blocks_forward_flops, checkpoint_blocks, find_blocks, forward_flops,
                       segment_bounds, sqrt_segments)
from .offload import OffloadStats, offload_activations, offload_naive
from .activations import GELUTanh, SiLU, gelu_tanh, gelu_tanh_naive, silu, silu_naive
from .fusion import compare_compiled, pointwise_chain, try_compile
