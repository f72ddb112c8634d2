"""DCT compression: chunk planning, blocked transform, top-k selection."""

from .chunking import ChunkPlan, choose_chunk, plan_chunks
from .dct import BlockDCT, Scratch, dct_matrix
from .select import topk_indices

__all__ = ["BlockDCT", "ChunkPlan", "Scratch", "choose_chunk", "dct_matrix", "plan_chunks",
           "topk_indices"]
