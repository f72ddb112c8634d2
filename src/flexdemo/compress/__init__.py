"""DCT compression: chunk planning, blocked transform, top-k selection, the statistical
codebook."""

from .chunking import ChunkPlan, choose_chunk, plan_chunks
from .codebook import stat_codebook
from .dct import BlockDCT, Scratch, dct_matrix
from .quant import ValueCodec
from .select import topk_indices

__all__ = ["BlockDCT", "ChunkPlan", "Scratch", "choose_chunk", "dct_matrix", "plan_chunks",
           "stat_codebook", "topk_indices", "ValueCodec"]
